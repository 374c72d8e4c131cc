"""Preference pairs: both styles encoded as TRL tokenizes them, truncation, whole pairs per batch, checks, bad
records."""
import functools
import json
import os

import numpy as np
import pytest

from jalign.data import pipeline, preference, synthetic
from jalign.data.sources import DataError, open_source
from jalign.tokenizers import tokenizer

TOK_DIR = os.path.join(os.path.dirname(synthetic.__file__), "..", "assets", "arith_tokenizer")
USER = [{"role": "user", "content": "What is 12 + 30?"}]
CONV = {"prompt": USER, "chosen": [{"role": "assistant", "content": "#### 42"}],
        "rejected": [{"role": "assistant", "content": "#### 41 maybe"}], "chosen_score": 0.0, "rejected_score": -0.7}
PLAIN = {"prompt": "What is 12 + 30?", "chosen": " #### 42", "rejected": " #### 41"}


@pytest.fixture(scope="module")
def tok():
  return tokenizer.load(TOK_DIR)


def _write_jsonl(path, records, raw_lines=()):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
    for line in raw_lines:
      f.write(line + "\n")
  return str(path)


def _trl_split(tok, prompt_messages, completion_messages):
  """TRL's DPO tokenisation: prompt rendered with the generation prompt; completion = the rest of the rendering."""
  prompt_ids = tok.encode(tok.render_chat(prompt_messages, add_generation_prompt=True), add_special_tokens=False)
  full = tok.encode(tok.render_chat(prompt_messages + completion_messages), add_special_tokens=False)
  assert full[:len(prompt_ids)] == prompt_ids
  return full, len(prompt_ids)


def test_conversational_pair_matches_trl_tokenisation(tok):
  ex = preference.encode(CONV, tok, max_length=64)
  for side in ("chosen", "rejected"):
    full, plen = _trl_split(tok, USER, CONV[side])
    assert ex[side].tolist() == full
    assert ex[side + "_mask"].tolist() == [0] * plen + [1] * (len(full) - plen)
  assert ex["chosen_score"] == 0.0 and ex["rejected_score"] == -0.7


def test_implicit_prompt_equals_explicit(tok):
  implicit = {"chosen": USER + CONV["chosen"], "rejected": USER + CONV["rejected"]}
  a, b = preference.encode(implicit, tok, max_length=64), preference.encode(CONV, tok, max_length=64)
  for k in ("chosen", "chosen_mask", "rejected", "rejected_mask"):
    np.testing.assert_array_equal(a[k], b[k])


def test_plain_pair_appends_eos(tok):
  ex = preference.encode(PLAIN, tok, max_length=64)
  p = tok.encode(PLAIN["prompt"])
  for side in ("chosen", "rejected"):
    c = tok.encode(PLAIN[side], add_special_tokens=False)
    assert ex[side].tolist() == p + c + [tok.eos_id]
    assert ex[side + "_mask"].tolist() == [0] * len(p) + [1] * (len(c) + 1)


def test_truncation_keeps_prompt_shared(tok):
  full = preference.encode(CONV, tok, max_length=64)
  n = len(full["rejected"]) - 2
  start = preference.encode(CONV, tok, max_length=n, truncation="keep_start")
  assert start["rejected"].tolist() == full["rejected"][:n].tolist()
  end = preference.encode(CONV, tok, max_length=n, truncation="keep_end")
  cut = len(full["rejected"]) - n  # the same prompt tokens dropped from both sides
  assert end["rejected"].tolist() == full["rejected"][cut:].tolist()
  assert end["chosen"].tolist() == full["chosen"][cut:].tolist()
  with pytest.raises(preference.TooLong):
    preference.encode(CONV, tok, max_length=n, truncation="drop")


def test_batch_holds_whole_pairs(tok):
  examples = [preference.encode(r, tok, max_length=64) for r in (CONV, {**CONV, "margin": 0.5})]
  b = preference.pair_batch((16, 32))(examples)
  assert b["tokens"].shape == (2, 2, 32) and b["tokens"].dtype == np.int32
  np.testing.assert_array_equal(b["tokens"][0, 0, :len(examples[0]["chosen"])], examples[0]["chosen"])
  np.testing.assert_array_equal(b["tokens"][1, 1, :len(examples[1]["rejected"])], examples[1]["rejected"])
  assert b["segment_ids"][0, 1].sum() == len(examples[0]["rejected"])
  np.testing.assert_array_equal(b["margin"], [0.0, 0.5])
  assert np.isnan(b["ref_chosen_logps"]).all()


def test_split_layout_holds_the_same_sequences(tok):
  """The split layout (shared prompt left-padded to P, completions right-padded) carries each side's tokens, loss
  mask and positions in order, the prompt once per pair marked by `prompt_mask`."""
  longer = {**PLAIN, "prompt": PLAIN["prompt"] + " Think.", "rejected": PLAIN["rejected"] + " or so"}
  examples = [preference.encode(r, tok, max_length=64) for r in (PLAIN, longer, {**PLAIN, "margin": 0.5})]
  b = preference.split_pair_batch(examples)
  shared = [preference.shared_prompt_length(e) for e in examples]
  assert shared == [len(tok.encode(r["prompt"])) for r in (PLAIN, longer, PLAIN)]
  pw = b["prompt_mask"].shape[1]
  assert pw == preference.split_width(max(shared)) and b["tokens"].shape[:2] == (3, 2)
  for i, e in enumerate(examples):
    assert b["prompt_mask"][i].tolist() == [0] * (pw - shared[i]) + [1] * shared[i]
    for s, side in enumerate(("chosen", "rejected")):
      real = b["segment_ids"][i, s] == 1
      np.testing.assert_array_equal(b["tokens"][i, s][real], e[side])
      np.testing.assert_array_equal(b["loss_mask"][i, s][real], e[side + "_mask"])
      np.testing.assert_array_equal(b["positions"][i, s][real], np.arange(len(e[side])))
      assert (np.diff(real[pw:].astype(int)) <= 0).all()  # completions right-padded
  np.testing.assert_array_equal(b["margin"], [0.0, 0.0, 0.5])
  wide = preference.widen_split(b, pw + 3, b["tokens"].shape[2] - pw + 2)
  assert wide["prompt_mask"].shape[1] == pw + 3 and wide["tokens"].shape[2] == b["tokens"].shape[2] + 5
  for k in ("tokens", "loss_mask", "positions"):
    np.testing.assert_array_equal(wide[k][wide["segment_ids"] == 1], b[k][b["segment_ids"] == 1])


def test_pipeline_batches_pairs(tmp_path, tok):
  path = _write_jsonl(tmp_path / "p.jsonl", [CONV] * 6)
  encode = functools.partial(preference.encode, tok=tok, max_length=64)
  spec = pipeline.PipelineSpec(batch_size=4, seq_len=32, packing=False, shuffle=True, seed=0)
  ds, _ = pipeline.build(open_source(path), encode, spec, batch_fn=preference.pair_batch((32,)))
  batch = next(iter(ds))
  assert batch["tokens"].shape == (4, 2, 32) and batch["loss_mask"].shape == (4, 2, 32)


def test_checks_report_identical_duplicates_and_length_imbalance(tmp_path, tok):
  records = [CONV, CONV, {**CONV, "rejected": CONV["chosen"]},
             {"prompt": [{"role": "user", "content": "What is 1 + 1?"}],
              "chosen": [{"role": "assistant", "content": "#### 2 because one and one make two, as you know"}],
              "rejected": [{"role": "assistant", "content": "#### 3"}]}]
  src = open_source(_write_jsonl(tmp_path / "p.jsonl", records))
  stats, _ = preference.check_pairs(src, functools.partial(preference.encode, tok=tok, max_length=64))
  assert stats.pairs == 4 and stats.identical == 1 and stats.duplicated_prompts == 2
  assert stats.length_ratio > 1.5
  problems = " ".join(stats.problems(1.5))
  assert "identical" in problems and "repeat" in problems and "length ratio" in problems
  assert stats.most_pairs_per_prompt == 3 and "repeat" not in " ".join(stats.problems(1.5, pairs_per_prompt=3))
  assert not stats.has_gold


@pytest.mark.parametrize("record, raw, message", [
    ({"prompt": "What is 1 + 1?", "chosen": " #### 2"}, None, r"p.jsonl:2: record has no 'rejected' field"),
    ({"prompt": USER, "chosen": [{"role": "assistant", "content": "  "}], "rejected": CONV["rejected"]}, None,
     r"p.jsonl:2: chosen\[0\] \(assistant\) has empty content"),
    ({"prompt": USER, "chosen": [], "rejected": CONV["rejected"]}, None,
     r"p.jsonl:2: field 'chosen' must be a non-empty list of messages"),
    ({"prompt": [{"role": "user", "content": "What is 1 + 1? " * 40}], "chosen": CONV["chosen"],
      "rejected": CONV["rejected"]}, None, r"p.jsonl:2: prompt has \d+ tokens, not fewer than max_length=64"),
    (PLAIN, None, r"p.jsonl:2: plain record in a dataset whose first record \(.*p.jsonl:1\) is conversational"),
    ({"prompt": "x", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}, None,
     r"p.jsonl:2: record mixes plain text and message lists"),
    (None, '{"prompt": "x", "chosen": "a", ', r"p.jsonl:2: bad JSON"),
    ({**CONV, "margin": "big"}, None, r"p.jsonl:2: field 'margin' must be a finite number"),
])
def test_bad_records_name_file_and_line(tmp_path, tok, record, raw, message):
  path = _write_jsonl(tmp_path / "p.jsonl", [CONV] + ([record] if record else []), [raw] if raw else [])
  encode = functools.partial(preference.encode, tok=tok, max_length=64)
  with pytest.raises(DataError, match=message):
    preference.check_pairs(open_source(path), encode)
  # skip_bad_records: the bad one is left out, the good one counted
  assert preference.check_pairs(open_source(path), encode, skip_bad_records=True)[0].pairs == 1


def test_shipped_reward_model_pairs_are_ones_digit_slips_of_train_questions():
  from jalign.data import arith_preferences

  prefs = os.path.join(os.path.dirname(synthetic.__file__), "..", "assets", "arith_prefs")
  shipped = [json.loads(line) for line in open(os.path.join(prefs, "rm_train.jsonl"))]
  assert shipped == arith_preferences.slip_pairs()  # the documented command rebuilds the file
  test_questions = {json.loads(line)["prompt"][0]["content"] for line in open(os.path.join(prefs, "test.jsonl"))}
  questions = [r["prompt"][0]["content"] for r in shipped]
  assert len(questions) == 2 * len(set(questions)) == 20_000 and not set(questions) & test_questions
  for r in shipped[:500]:
    a, op, b = r["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split()
    truth = int(a) + int(b) if op == "+" else int(a) - int(b)
    slip = int(r["rejected"][0]["content"].removeprefix("#### ")) - truth
    assert r["chosen"][0]["content"] == f"#### {truth}" and 1 <= abs(slip) <= 3
    assert r["rejected_score"] == pytest.approx(-np.log1p(abs(slip))) and r["chosen_score"] == 0.0


def test_shipped_magnitude_pairs_are_tens_slips_and_sign_flips_of_train_questions():
  from jalign.data import arith_preferences

  prefs = os.path.join(os.path.dirname(synthetic.__file__), "..", "assets", "arith_prefs")
  shipped = [json.loads(line) for line in open(os.path.join(prefs, "rm_magnitude.jsonl"))]
  assert shipped == arith_preferences.magnitude_pairs()  # the documented command rebuilds the file
  ones = [json.loads(line) for line in open(os.path.join(prefs, "rm_train.jsonl"))]
  assert [r["prompt"] for r in shipped] == [r["prompt"] for r in ones]  # the same train questions, two each
  for r in shipped[:500]:
    a, op, b = r["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split()
    truth = int(a) + int(b) if op == "+" else int(a) - int(b)
    wrong = int(r["rejected"][0]["content"].removeprefix("#### "))
    assert r["chosen"][0]["content"] == f"#### {truth}" and wrong != truth
    assert wrong - truth in (-20, -10, 10, 20) or wrong == -truth
    assert r["rejected_score"] == pytest.approx(-np.log1p(abs(wrong - truth))) and r["chosen_score"] == 0.0
