"""Tool use, learned: the shipped tiny policy is taught to call a calculator (an SFT warm start on a few scripted
tool-use traces), then GRPO trains it on whole episodes of the calculator environment. The task, 4-digit x 4-digit
multiplication (synthetic:mul), is far past what the policy computes: the tools are the only way to be right.

    python -m jalign.run --config=configs/agent.py          # about 17 minutes on 2 CPU cores
    python -m jalign.run --config=configs/agent.py:tiny     # seconds, for tests

Held-out accuracy is measured greedily, with tools (whole episodes: eval/accuracy) and without (one answer to the
same prompts: eval/accuracy_no_tools), before GRPO (eval/*_initial: the warm-started policy) and after; the base
policy, without tools, is evaluated first (run_dir/0_base). The traces are jalign/assets/agent_traces/train.jsonl
(`python -m jalign.rl.agentic.traces`, see that module): 1,024 tool-use episodes and 256 plain answers. The calls are in the
compact format (`<<1234*5678>>`): the policy's 128-token context has no room for JSON tool schemas.
Measured (benchmarks/README.md): 0.0% without tools throughout; with the calculator 22.8% after SFT -> 33.2% after
GRPO.
"""
import importlib.util
import os

import ml_collections


def get_config(arg=None):
  if arg not in (None, "", "tiny"):
    raise ValueError(f"configs/agent.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  tiny = arg == "tiny"
  # The chain of stages of configs/pipeline.py (each stage a full config of its task), cut to SFT -> GRPO.
  spec = importlib.util.spec_from_file_location("configs_pipeline", os.path.join(os.path.dirname(__file__),
                                                                                 "pipeline.py"))
  pipeline = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(pipeline)
  c = pipeline.get_config(arg)
  c.run_dir = "runs/agent" if not tiny else "runs/agent_tiny"
  c.order = ("sft", "grpo")
  c.rm_weight = 0.0
  c.stages = ml_collections.ConfigDict({"sft": c.stages.sft, "grpo": c.stages.grpo})
  sft, grpo = c.stages.sft, c.stages.grpo
  # The warm start: the traces, from the shipped policy (the pipeline sets model.path), every assistant turn learned.
  # (tiny: the fewest steps after which the policy calls the tool, so that the tests run the tool path)
  sft.data.update(train=os.path.join(os.path.dirname(c.base_model), "agent_traces", "train.jsonl"), eval="",
                  max_length=128)
  sft.train.update(steps=800 if not tiny else 60, batch_size=16 if not tiny else 8, seq_len=128, eval_every=0,
                   eval_examples=0, eval_batches=0)
  sft.optim.update(lr=2e-3 if not tiny else 3e-3, warmup_steps=20 if not tiny else 0, min_lr_ratio=0.1)
  sft.checkpoint.every = 200 if not tiny else 30
  # GRPO on episodes: each sample is an episode of the calculator environment (a call, its result, an answer).
  grpo.grpo.update(prompts="synthetic:mul:train", eval_prompts="synthetic:mul:test")
  grpo.env.update(name="calculator", tool_format="compact", max_turns=3, max_tokens=128)
  grpo.sampling.update(max_new_tokens=16, max_prompt_length=64)
  grpo.train.update(steps=300 if not tiny else 2, eval_every=50 if not tiny else 0)
  grpo.optim.update(lr=1e-4, schedule="constant", warmup_steps=0)
  grpo.checkpoint.every = 50 if not tiny else 1
  if not tiny:
    grpo.grpo.update(prompts_per_step=32, eval_examples=500)
  # The pipeline's own evaluation: one answer, no tools, on the held-out products.
  c.eval.update(prompts="synthetic:mul:test", sft_data="", num_samples=0, pass_k=(1,))
  return c
