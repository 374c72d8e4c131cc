"""Datasets as they come (jalign.data.layouts, .json arrays, .gz): GSM8K, MATH, HH-RLHF, UltraFeedback, ShareGPT and
LLaMA-Factory records mapped onto TRL's layouts; real files from ../shared/realdata where present."""
import gzip
import json
import shutil

import numpy as np
import pytest

from jalign.data import layouts, preference, sft
from jalign.data.layouts import Fields
from jalign.data.prompts import PromptError, encode_prompt
from jalign.data.sources import DataError, open_source
from jalign.rewards.verifiable import REGISTRY, Batch
from tests import realdata

GSM8K = {"question": "Natalia sold 48 clips in April and half as many in May. How many altogether?",
         "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 1,072"}
MATH = {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "level": "Level 1",
        "solution": "We have $\\frac{1}{2}+\\frac{1}{4} = \\boxed{\\frac{3}{4}}$."}
HH = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a fruit.\n\nAssistant: An apple.",
      "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a fruit.\n\nAssistant: No."}


def _score(name, completions, truths):
  return REGISTRY[name](Batch(completions, truths, np.zeros(len(completions)))).tolist()


def test_gsm8k_record_becomes_a_prompt_with_the_number_after_hashes():
  out = Fields()(GSM8K)
  assert out["prompt"] == [{"role": "user", "content": GSM8K["question"]}]
  assert out["completion"] == [{"role": "assistant", "content": GSM8K["answer"]}]
  assert out["ground_truth"] == "1072"
  # the gold solution, read as-is on either side, scores 1; a wrong number 0
  assert _score("gsm8k", [GSM8K["answer"], "#### 1072", "#### 72"], [GSM8K["answer"], "1072", "1072"]) == [1, 1, 0]


def test_math_record_takes_the_last_boxed_answer():
  out = Fields()(MATH)
  assert out["ground_truth"] == "\\frac{3}{4}"
  assert _score("boxed", [MATH["solution"], "so \\boxed{\\frac{3}{4}}", "\\boxed{3/4}"],
                [MATH["solution"], out["ground_truth"], MATH["solution"]]) == [1, 1, 0]
  assert Fields()({**MATH, "answer": "3/4"})["ground_truth"] == "3/4"  # MATH-500's own answer field wins


def test_hh_transcripts_split_into_shared_prompt_and_replies():
  out = Fields()(HH)
  assert [m["role"] for m in out["prompt"]] == ["user", "assistant", "user"]
  assert out["prompt"][-1]["content"] == "Name a fruit."
  assert out["chosen"] == [{"role": "assistant", "content": "An apple."}]
  assert out["rejected"] == [{"role": "assistant", "content": "No."}]
  with pytest.raises(DataError, match="not an HH-RLHF transcript"):
    Fields("hh_rlhf")({"chosen": "Human: hi", "rejected": "x"})


def test_ultrafeedback_sharegpt_and_kto_messages():
  conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}]
  uf = {"prompt": "q", "chosen": conv, "rejected": conv[:1] + [{"role": "assistant", "content": "bad"}],
        "score_chosen": 8.0, "score_rejected": 3.5}
  out = Fields()(uf)
  assert out == {"chosen": conv, "rejected": uf["rejected"], "chosen_score": 8.0, "rejected_score": 3.5}
  share = {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"},
           "rejected": {"from": "gpt", "value": "b"}, "system": "be brief"}
  out = Fields()(share)
  assert out["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
  assert out["chosen"] == [{"role": "assistant", "content": "a"}]
  assert Fields()({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}) == {
      "messages": conv[:1] + [{"role": "assistant", "content": "a"}]}
  with pytest.raises(DataError, match="'from' \\(one of human"):
    Fields()({"conversations": [{"from": "robot", "value": "q"}]})
  kto = Fields()({"messages": conv, "label": False})
  assert kto == {"prompt": conv[:1], "completion": conv[1:], "label": False}


def test_trl_and_verl_records_pass_through_unchanged():
  for record in ({"prompt": "q", "answer": "3"}, {"prompt": "q", "chosen": "a", "rejected": "b"},
                 {"messages": [{"role": "user", "content": "q"}]}, {"prompt": "q", "completion": "a"},
                 {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "3"}},
                 {"question": "no hashes", "answer": "3"}):
    assert Fields()(record) == record


def test_keys_name_the_fields_of_any_dataset():
  f = Fields(prompt_key="query", answer_key="meta.final")
  out = f({"query": "2+2?", "answer": "stray", "meta": {"final": "#### 4"}})
  assert out["prompt"] == "2+2?" and out["ground_truth"] == "4" and "answer" not in out
  with pytest.raises(DataError, match=r"'meta.final' \(data.answer_key\) not in this record"):
    f({"query": "x", "meta": {}})
  with pytest.raises(DataError, match="needs field\\(s\\) \\['problem', 'solution'\\]"):
    Fields("math")(GSM8K)
  with pytest.raises(DataError, match="accepted: auto, none, gsm8k"):
    Fields("alpaca")


def test_config_layouts_are_the_modules(tmp_path):
  import typing

  from jalign.data.pipeline import DataSection
  hints = typing.get_type_hints(DataSection)
  assert typing.get_args(hints["layout"]) == layouts.NAMES


def test_json_arrays_and_gzip_with_record_lines(tmp_path):
  array = tmp_path / "d.json"
  array.write_text('[\n  {"question": "q1", "answer": "a\\n#### 1"},\n\n  {"prompt": "p",\n   "answer": "2"}\n]\n')
  src = open_source(str(array))
  assert len(src) == 2 and src.where(0).endswith("d.json:2") and src.where(1).endswith("d.json:4")
  assert src[0]["ground_truth"] == "1" and src[1] == {"prompt": "p", "answer": "2"}
  (tmp_path / "bad.json").write_text('[{"a": 1},\n {"a": }]')
  with pytest.raises(DataError, match="bad.json:2: bad JSON"):
    open_source(str(tmp_path / "bad.json"))
  lines = tmp_path / "d.jsonl.gz"
  with gzip.open(lines, "wt") as f:
    f.write(json.dumps(HH) + "\n\n" + '{"chosen": "x"' + "\n")
  src = open_source(str(lines))
  assert len(src) == 2 and src[0]["chosen"][0]["content"] == "An apple."
  with pytest.raises(DataError, match="d.jsonl.gz:3: bad JSON"):
    src[1]
  with pytest.raises(DataError, match="accepted: .jsonl, .json"):
    open_source(str(tmp_path / "d.parquet.gz"))


def test_prompt_error_names_the_keys_and_the_layouts():
  from jalign.tokenizers.tokenizer import load
  tok = load("jalign/assets/arith_tokenizer")
  with pytest.raises(PromptError, match=r"it has \['query'\]\); name the prompt's field with data.prompt_key"):
    encode_prompt({"query": "1+1"}, tok, index=0, where="f.jsonl:3", max_length=64)


# ------------------------------------------------------------------------------------------------ real files


def test_every_gold_gsm8k_solution_scores_one_read_as_is():
  src = open_source(realdata.path("gsm8k/train.jsonl"), Fields("none"))
  answers = [src[i]["answer"] for i in range(len(src))]
  assert len(answers) == 7473
  assert _score("gsm8k", answers, answers) == [1.0] * len(answers)
  mapped = open_source(realdata.path("gsm8k/train.jsonl"))
  truths = [mapped[i]["ground_truth"] for i in range(len(mapped))]
  assert all(t.lstrip("-").replace(".", "").isdigit() for t in truths)
  assert _score("gsm8k", answers, truths) == [1.0] * len(answers)


def test_hh_rlhf_test_split_reads_and_encodes_with_a_real_template():
  from jalign.tokenizers.tokenizer import load
  src = open_source(realdata.path("hh-rlhf/helpful-base_test.jsonl.gz"))
  assert len(src) == 2354
  tok = load(realdata.path("tokenizers/qwen3"))
  encoded, empty = 0, 0
  for i in range(0, len(src), 7):
    record = src[i]
    assert record["prompt"][-1]["role"] == "user"
    try:
      ex = preference.encode(record, tok, max_length=4096)
    except DataError as e:
      # 4 of 2,354 HH replies are empty; 10 rejected sides run on for more turns, which Qwen3's template renders
      # differently once a later user turn follows (its thinking block moves), so their tokens cannot be located
      assert "empty" in str(e) or "incrementally" in str(e)
      empty += 1
      continue
    encoded += 1
    n = preference.shared_prompt_length(ex)
    assert n > 0 and ex["chosen_mask"][:n].sum() == 0 and ex["chosen_mask"][n:].sum() > 0
  assert encoded > 320 and empty <= 4


def test_llama_factory_demo_sets():
  from jalign.tokenizers.tokenizer import load
  tok = load(realdata.path("tokenizers/llama3"))
  dpo = open_source(realdata.path("preference/llama-factory/dpo_en_demo.json"))
  assert len(dpo) == 300
  for i in range(0, 300, 50):
    ex = preference.encode(dpo[i], tok, max_length=8192)
    assert ex["chosen_mask"].sum() > 0 and ex["rejected_mask"].sum() > 0
  kto = open_source(realdata.path("preference/llama-factory/kto_en_demo.json"))
  labels = [kto[i]["label"] for i in range(len(kto))]
  assert len(labels) == 300 and 0 < sum(labels) < 300
  ex = preference.encode_unpaired(kto[0], tok, max_length=8192)["examples"]
  assert len(ex) == 1 and ex[0][3] == float(kto[0]["label"])
  # an SFT view of the same conversations: loss on the assistant turns only
  rec = {"messages": kto[0]["prompt"] + kto[0]["completion"]}
  out = sft.encode(rec, tok, max_length=8192)
  assert 0 < out["loss_mask"].sum() < len(out["tokens"])


# SentencePiece models beside a chat template of the same version (Mistral's HF templates for its .model files).
SPM_TEMPLATES = {"mistral_v1": ("tokenizers/mistral/tokenizer.model.v1",
                                "tokenizers/mistral/chat_template_v1_spm.jinja"),
                 "mistral_v3": ("tokenizers/mistral/mistral_instruct_tokenizer_240323.model.v3",
                                "tokenizers/mistral/chat_template_v3_spm.jinja"),
                 "mistral_v7": ("tokenizers/mistral/mistral_instruct_tokenizer_241114.model.v7",
                                "tokenizers/mistral/chat_template_v7_spm.jinja")}


def _tokenizer_dir(name, tmp_path):
  if name not in SPM_TEMPLATES:
    return realdata.path(f"tokenizers/{name}")
  model, template = SPM_TEMPLATES[name]
  shutil.copyfile(realdata.path(model), tmp_path / "tokenizer.model")
  shutil.copyfile(realdata.path(template), tmp_path / "chat_template.jinja")
  return str(tmp_path)


@pytest.mark.parametrize("name", ["qwen3", "llama3", "gemma3", *SPM_TEMPLATES])
def test_chat_ids_equal_transformers_on_gsm8k_and_hh_conversations(name, tmp_path):
  """Real tokenizers and their real templates, on the mapped records of real datasets: the HF-format tokenizers of
  ../shared/realdata, and its Mistral SentencePiece models with their templates (transformers converts the .model
  itself, jalign.tokenizers.spm independently). Llama 2's model has no template: tests/test_tokenizer.py checks its ids."""
  import transformers

  from jalign.tokenizers.tokenizer import load
  directory = _tokenizer_dir(name, tmp_path)
  ours, theirs = load(directory), transformers.AutoTokenizer.from_pretrained(directory)
  gsm8k = open_source(realdata.path("gsm8k/train.jsonl"))
  hh = open_source(realdata.path("hh-rlhf/helpful-base_test.jsonl.gz"))
  conversations = [(gsm8k[i]["prompt"], True) for i in range(0, 7000, 700)]
  conversations += [(gsm8k[i]["prompt"] + gsm8k[i]["completion"], False) for i in range(0, 7000, 700)]
  conversations += [(hh[i]["prompt"] + hh[i]["chosen"], False) for i in range(0, 2300, 230)]
  conversations += [(hh[i]["prompt"], True) for i in range(0, 2300, 230)]
  assert any(len(m) > 3 for m, _ in conversations)   # multi-turn HH transcripts among them
  for messages, gen in conversations:
    want = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == list(want), (name, messages[-1])


def test_a_slice_of_a_spec_gives_train_and_held_out_splits(tmp_path):
  f = tmp_path / "d.jsonl"
  f.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(10)))
  held = open_source(f"{f}[-3:]")
  assert [held[i]["answer"] for i in range(len(held))] == ["7", "8", "9"] and held.where(0).endswith("d.jsonl:8")
  train = open_source(f"{f}[:70%]")
  assert len(train) == 7 and train[6]["answer"] == "6"
  assert len(open_source(f"{f}[ 2 : 4 ]")) == 2
  with pytest.raises(DataError, match="selects none of the 10 records"):
    open_source(f"{f}[5:5]")
  with pytest.raises(DataError, match="not a percentage"):
    open_source(f"{f}[:150%]")


def test_prompt_suffix_goes_on_the_last_user_turn():
  suffix = ' Output the final answer after "####".'
  out = Fields(prompt_suffix=suffix)(GSM8K)
  assert out["prompt"] == [{"role": "user", "content": GSM8K["question"] + suffix}]
  assert Fields(prompt_suffix="!")({"prompt": "q", "answer": "1"})["prompt"] == "q!"
  assert Fields(prompt_suffix="!")(HH)["prompt"][-1]["content"] == "Name a fruit.!"
  assert "prompt" not in Fields(prompt_suffix="!")({"messages": [{"role": "user", "content": "q"}]})
