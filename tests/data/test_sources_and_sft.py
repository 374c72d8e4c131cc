"""Data sources, SFT encoding (loss masks), packing, bad records, and exact iterator resume."""
import dataclasses
import functools
import json
import os

import numpy as np
import pytest

from jalign.data import pipeline, sft, synthetic
from jalign.data.sources import DataError, open_source
from jalign.tokenizers import tokenizer

TOK_DIR = os.path.join(os.path.dirname(synthetic.__file__), "..", "assets", "arith_tokenizer")
RECORDS = [
    {"messages": [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"}]},
    {"prompt": "What is 5 - 1?", "completion": " #### 4"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                  {"role": "assistant", "content": "#### 4"}, {"role": "user", "content": "And 3 + 3?"},
                  {"role": "assistant", "content": "#### 6"}]},
]


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


def test_sources_read_the_same_records(tmp_path):
  import array_record.python.array_record_module as ar
  import pyarrow as pa
  import pyarrow.parquet as pq
  flat = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]
  jsonl = _write_jsonl(tmp_path / "d.jsonl", flat)
  pq.write_table(pa.Table.from_pylist(flat), tmp_path / "d.parquet")
  writer = ar.ArrayRecordWriter(str(tmp_path / "d.arrayrecord"), "group_size:1")
  for r in flat:
    writer.write(json.dumps(r).encode())
  writer.close()
  for spec in (jsonl, str(tmp_path / "d.parquet"), str(tmp_path / "d.arrayrecord")):
    src = open_source(spec)
    assert [src[i] for i in range(len(src))] == flat, spec
  both = open_source(f"{jsonl},{tmp_path / 'd.parquet'}")
  assert len(both) == 10 and both[7] == flat[2] and both.where(7).endswith("d.parquet:row 2")
  assert len(open_source(str(tmp_path / "d.*l"))) == 5  # glob


def test_tfds_prepared_directory_without_tensorflow(tmp_path):
  import tensorflow_datasets as tfds

  class Tiny(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {"prompt": tfds.features.Text(), "completion": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for i in range(4):
        yield i, {"prompt": f"What is {i} + 1?", "completion": f" #### {i + 1}"}

  Tiny(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
  src = open_source(f"tfds:tiny:train@{tmp_path}")
  assert len(src) == 4
  assert sorted(src[i]["completion"] for i in range(4)) == [" #### 1", " #### 2", " #### 3", " #### 4"]


def test_messages_loss_mask_covers_assistant_turns_only(tok):
  ex = sft.encode(RECORDS[2], tok, max_length=256)
  text = tok.decode(ex["tokens"], skip_special_tokens=False)
  learned = tok.decode(ex["tokens"][ex["loss_mask"] == 1], skip_special_tokens=False)
  assert text == tok.render_chat(RECORDS[2]["messages"])
  # Both assistant turns, each with its end-of-turn marker; nothing of the system/user turns.
  assert learned == "#### 4<|im_end|>\n#### 6<|im_end|>\n"


def test_prompt_completion_strings(tok):
  ex = sft.encode(RECORDS[1], tok, max_length=256)
  learned = tok.decode(ex["tokens"][ex["loss_mask"] == 1], skip_special_tokens=False)
  assert learned == " #### 4<|im_end|>"  # completion + eos
  assert tok.decode(ex["tokens"], skip_special_tokens=False) == "What is 5 - 1? #### 4<|im_end|>"


def test_prompt_completion_messages(tok):
  rec = {"prompt": [{"role": "user", "content": "What is 7 + 1?"}],
         "completion": [{"role": "assistant", "content": "#### 8"}]}
  ex = sft.encode(rec, tok, max_length=256)
  assert tok.decode(ex["tokens"][ex["loss_mask"] == 1], skip_special_tokens=False) == "#### 8<|im_end|>\n"


def test_truncation(tok):
  full = sft.encode(RECORDS[2], tok, max_length=256)
  first_learned = int(np.argmax(full["loss_mask"]))
  start = sft.encode(RECORDS[2], tok, max_length=first_learned + 3, truncation="keep_start")
  end = sft.encode(RECORDS[2], tok, max_length=20, truncation="keep_end")
  np.testing.assert_array_equal(start["tokens"], full["tokens"][:first_learned + 3])
  np.testing.assert_array_equal(start["loss_mask"], full["loss_mask"][:first_learned + 3])
  np.testing.assert_array_equal(end["tokens"], full["tokens"][-20:])
  with pytest.raises(sft.TooLong):
    sft.encode(RECORDS[2], tok, max_length=20, truncation="drop")
  with pytest.raises(DataError, match="no completion tokens left"):
    sft.encode(RECORDS[2], tok, max_length=first_learned, truncation="keep_start")


@pytest.mark.parametrize("record, message", [
    ({"text": "hi"}, r"neither 'messages' nor 'prompt'\+'completion' \(keys: \['text'\]\)"),
    ({"messages": "hi"}, r"field 'messages' must be a non-empty list of messages, found str"),
    ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\] must be an object with string 'role' and "
                                                      r"'content'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"'messages' has no assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
     r"messages\[1\] \(assistant\) has empty content"),
    ({"prompt": "hi", "completion": ""}, r"field 'completion' is empty"),
    ({"prompt": 5, "completion": "x"}, r"field 'prompt' must be a string or a message list, found int"),
])
def test_malformed_records(tok, record, message):
  with pytest.raises(DataError, match=message):
    sft.encode(record, tok, max_length=64)


def _pipeline(path, tok, **kw):
  spec = pipeline.PipelineSpec(**{"batch_size": 2, "seq_len": 64, "shuffle": False, **kw})
  enc = functools.partial(sft.encode, tok=tok, max_length=64)
  return pipeline.build(open_source(path), enc, spec)


def test_bad_json_line_stops_with_file_and_line(tmp_path, tok):
  path = _write_jsonl(tmp_path / "bad.jsonl", RECORDS[:2], raw_lines=['{"prompt": "x", "completion": '])
  ds, _ = _pipeline(path, tok, num_epochs=1, drop_remainder=False)
  with pytest.raises(DataError, match=r"bad.jsonl:3: bad JSON .*skip_bad_records"):
    list(ds)


def test_skip_bad_records_counts_them(tmp_path, tok):
  path = _write_jsonl(tmp_path / "mixed.jsonl", RECORDS * 3 + [{"text": "no"}],
                      raw_lines=["not json", '{"messages": []}'])
  ds, counters = _pipeline(path, tok, num_epochs=1, drop_remainder=False, skip_bad_records=True, packing=False)
  batches = list(ds)
  assert sum(len(b["tokens"]) for b in batches) == 9
  assert counters.bad == 3


def test_packing_keeps_every_token_once_with_segments(tok):
  src = open_source("synthetic:arith:train:40")
  enc = functools.partial(sft.encode, tok=tok, max_length=64)
  singles = [enc(src[i]) for i in range(len(src))]
  ds, _ = pipeline.build(src, enc, pipeline.PipelineSpec(batch_size=4, seq_len=64, shuffle=False, num_epochs=1,
                                                          drop_remainder=False))
  seen = []
  for b in ds:
    for row in range(len(b["tokens"])):
      seg, pos = b["segment_ids"][row], b["positions"][row]
      for s in range(1, seg.max() + 1):
        sel = seg == s
        np.testing.assert_array_equal(pos[sel], np.arange(sel.sum()))
        seen.append((tuple(b["tokens"][row][sel]), tuple(b["loss_mask"][row][sel])))
  assert sorted(seen) == sorted((tuple(e["tokens"]), tuple(e["loss_mask"])) for e in singles)


def test_bucketed_padding(tok):
  src = open_source("synthetic:arith:train:16")
  enc = functools.partial(sft.encode, tok=tok, max_length=64)
  ds, _ = pipeline.build(src, enc, pipeline.PipelineSpec(batch_size=4, seq_len=64, packing=False,
                                                          buckets=(16, 32, 64), shuffle=False, num_epochs=1))
  for b in ds:
    assert b["tokens"].shape[1] == 32  # arithmetic examples are 17-25 tokens
    assert (b["segment_ids"].sum(1) >= 17).all()


def test_iterator_state_resumes_exactly(tok):
  src = open_source("synthetic:arith:train:300")
  enc = functools.partial(sft.encode, tok=tok, max_length=64)
  spec = pipeline.PipelineSpec(batch_size=4, seq_len=64, seed=5)
  it = iter(pipeline.build(src, enc, spec)[0])
  for _ in range(7):
    next(it)
  state = it.get_state()
  expected = [next(it)["tokens"] for _ in range(5)]
  again = iter(pipeline.build(src, enc, spec)[0])
  again.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(again)["tokens"], want)


def test_empty_dataset(tmp_path, tok):
  path = _write_jsonl(tmp_path / "empty.jsonl", [])
  with pytest.raises(DataError, match="empty.jsonl: the dataset is empty"):
    _pipeline(path, tok)


def test_unknown_file_type(tmp_path):
  (tmp_path / "d.csv").write_text("a,b\n")
  with pytest.raises(DataError, match=r"unknown data file type '.csv'; accepted: .jsonl"):
    open_source(str(tmp_path / "d.csv"))


def test_group_by_length_batches_similar_lengths_and_resumes_exactly():
  """Windows of 4 batches sorted by length: each batch's lengths are a run of the window's sorted lengths, every
  record is served once per epoch, and an iterator restored mid-window continues with the same examples."""
  from jalign.data import pipeline
  from jalign.data.sources import ListSource
  lengths = np.random.default_rng(0).integers(1, 200, size=64)
  source = ListSource([{"n": int(n)} for n in lengths])
  encode = lambda r: {"tokens": np.ones(r["n"], np.int32), "loss_mask": np.ones(r["n"], np.int32)}  # noqa: E731
  spec = pipeline.PipelineSpec(batch_size=4, seq_len=256, packing=False, buckets=(256,), seed=3, num_epochs=1,
                               drop_remainder=False, group_by_length=4)
  batches = list(pipeline.build(source, encode, spec)[0])
  served = [int(n) for b in batches for n in b["segment_ids"].sum(1)]
  assert sorted(served) == sorted(lengths.tolist())  # each record once
  for w in range(0, len(batches), 4):  # within a window, batches hold consecutive sorted lengths
    window = sorted(n for b in batches[w:w + 4] for n in b["segment_ids"].sum(1))
    for b in batches[w:w + 4]:
      mine = sorted(b["segment_ids"].sum(1))
      i = window.index(mine[0])
      assert window[i:i + 4] == mine
  # with several bucket widths, grouped batches pad far less than batches in data order
  buckets = dataclasses.replace(spec, buckets=(32, 64, 128, 256))
  pad = lambda s: sum(b["tokens"].size - b["segment_ids"].sum() for b in pipeline.build(source, encode, s)[0])  # noqa: E731
  assert pad(buckets) < 0.5 * pad(dataclasses.replace(buckets, group_by_length=0))
  # resume: state after 5 batches (inside the second window) restores onto a fresh iterator
  train = dataclasses.replace(spec, num_epochs=None, drop_remainder=True)
  it = iter(pipeline.build(source, encode, train)[0])
  for _ in range(5):
    next(it)
  state = it.get_state()
  expected = [next(it)["segment_ids"].sum(1).tolist() for _ in range(10)]
  fresh = iter(pipeline.build(source, encode, train)[0])
  fresh.set_state(state)
  assert [next(fresh)["segment_ids"].sum(1).tolist() for _ in range(10)] == expected
