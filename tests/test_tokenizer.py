"""Chat-template ids equal transformers' apply_chat_template; tokenizer files load and save; bad templates fail."""
import json
import os
from collections.abc import Mapping

import pytest
import transformers
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tk_models

from jalign.tokenizers import tokenizer as jtok

SPECIALS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>"]

# Templates in the formats of three families (ChatML as Qwen uses, Llama 3 headers, Gemma turns), plus one using
# whitespace control, namespace, tojson and loop controls.
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] "
        "+ '\\n\\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
        "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] "
        "| trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}"
        "{% endif %}"),
    "whitespace": (
        "{%- set ns = namespace(turns=0) -%}\n"
        "{%- for message in messages %}\n"
        "  {%- if message['role'] == 'system' %}\n"
        "<|im_start|>system {{ message['content'] | tojson }}<|im_end|>\n"
        "  {%- continue %}\n"
        "  {%- endif %}\n"
        "  {%- set ns.turns = ns.turns + 1 %}\n"
        "<|im_start|>{{ message['role'] }} #{{ ns.turns }}\n"
        "{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}\n"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "  Blue. "}, {"role": "user", "content": "Another one, \"please\" <ok>?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact about the number 7."},
     {"role": "assistant", "content": "It is prime.\nAnd odd."}],
]


def _train_tokenizer() -> Tokenizer:
  tk = Tokenizer(tk_models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  corpus = [m["content"] for conv in CONVERSATIONS for m in conv] * 20 + ["system user assistant model"] * 20
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tk.train_from_iterator(corpus, trainer)
  return tk


@pytest.fixture(scope="module")
def hf_tokenizer_dirs(tmp_path_factory):
  base = _train_tokenizer()
  out = {}
  for name, template in TEMPLATES.items():
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=base, bos_token="<bos>", eos_token="<eos>",
                                              pad_token="<pad>", chat_template=template)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    out[name] = (hf, str(path))
  return out


def _hf_ids(hf, conv, add_generation_prompt):
  out = hf.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True)
  return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_ids_equal_transformers(hf_tokenizer_dirs, name, add_generation_prompt):
  hf, path = hf_tokenizer_dirs[name]
  tok = jtok.load(path)
  for conv in CONVERSATIONS:
    if name == "gemma" and conv[-1]["role"] == "assistant" and add_generation_prompt:
      continue  # not a prompt shape this template is used for; covered without the generation prompt
    want = _hf_ids(hf, conv, add_generation_prompt)
    assert tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt) == want
    assert tok.render_chat(conv, add_generation_prompt=add_generation_prompt) == hf.apply_chat_template(
        conv, add_generation_prompt=add_generation_prompt, tokenize=False)


def test_special_tokens_encode_decode(hf_tokenizer_dirs):
  hf, path = hf_tokenizer_dirs["chatml"]
  tok = jtok.load(path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
  assert tok.vocab_size == len(hf)
  text = "Name a colour, please."
  assert tok.encode(text) == hf(text)["input_ids"]
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode([tok.eos_id] + tok.encode("Hi")) == "Hi"


def test_template_in_tokenizer_config_older_layout(hf_tokenizer_dirs, tmp_path):
  """Older checkpoints keep the template inside tokenizer_config.json (a string, or a list of named ones)."""
  hf, path = hf_tokenizer_dirs["llama3"]
  for f in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(path, f)) as src, open(tmp_path / f, "w") as dst:
      dst.write(src.read())
  cfg = json.load(open(tmp_path / "tokenizer_config.json"))
  cfg["chat_template"] = [{"name": "default", "template": TEMPLATES["llama3"]},
                          {"name": "chatml", "template": TEMPLATES["chatml"]}]
  json.dump(cfg, open(tmp_path / "tokenizer_config.json", "w"))
  tok = jtok.load(str(tmp_path))
  conv = CONVERSATIONS[1]
  assert tok.apply_chat_template(conv) == _hf_ids(hf, conv, False)
  chatml = hf_tokenizer_dirs["chatml"][0]
  assert tok.apply_chat_template(conv, template="chatml") == _hf_ids(chatml, conv, False)


def test_save_copies_files(hf_tokenizer_dirs, tmp_path):
  _, path = hf_tokenizer_dirs["gemma"]
  jtok.load(path).save(str(tmp_path))
  again = jtok.load(str(tmp_path))
  assert again.apply_chat_template(CONVERSATIONS[0]) == jtok.load(path).apply_chat_template(CONVERSATIONS[0])


def _with_template(hf_tokenizer_dirs, tmp_path, template: str) -> str:
  _, path = hf_tokenizer_dirs["chatml"]
  for f in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(path, f)) as src, open(tmp_path / f, "w") as dst:
      dst.write(src.read())
  (tmp_path / "chat_template.jinja").write_text(template)
  return str(tmp_path)


def test_malformed_template_names_file_and_line(hf_tokenizer_dirs, tmp_path):
  path = _with_template(hf_tokenizer_dirs, tmp_path, "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
  with pytest.raises(jtok.ChatTemplateError, match=r"chat_template.jinja: chat template 'default' line 2"):
    jtok.load(path)


def test_template_cannot_reach_python_internals(hf_tokenizer_dirs, tmp_path):
  path = _with_template(hf_tokenizer_dirs, tmp_path,
                        "{{ messages.__class__.__mro__[1].__subclasses__() }}")
  with pytest.raises(jtok.ChatTemplateError, match="unsafe|failed"):
    jtok.load(path).apply_chat_template(CONVERSATIONS[0])
  path = _with_template(hf_tokenizer_dirs, tmp_path, "{{ messages.append(1) }}")
  with pytest.raises(jtok.ChatTemplateError):
    jtok.load(path).apply_chat_template(CONVERSATIONS[0])


def test_template_raise_exception_is_reported(hf_tokenizer_dirs):
  tok = jtok.load(hf_tokenizer_dirs["gemma"][1])
  with pytest.raises(jtok.ChatTemplateError, match="roles must alternate"):
    tok.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_bad_tokenizer_files(tmp_path, hf_tokenizer_dirs):
  with pytest.raises(jtok.TokenizerError, match="neither tokenizer.json"):
    jtok.load(str(tmp_path))
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(jtok.TokenizerError, match="tokenizer.json: cannot be read"):
    jtok.load(str(tmp_path))
  _, path = hf_tokenizer_dirs["chatml"]
  (tmp_path / "tokenizer.json").write_text(open(os.path.join(path, "tokenizer.json")).read())
  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>",\n "bos_token": }')
  with pytest.raises(jtok.TokenizerError, match=r"tokenizer_config.json:2: not valid JSON"):
    jtok.load(str(tmp_path))
  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<not-a-token>"}')
  with pytest.raises(jtok.TokenizerError, match="eos_token '<not-a-token>' is not in the vocabulary"):
    jtok.load(str(tmp_path))


# SentencePiece models (jalign.tokenizers.spm) against the sentencepiece library itself -----------------------------------------

SPM_MODELS = ["tokenizers/llama2/tokenizer.model", "tokenizers/mistral/tokenizer.model.v1",
              "tokenizers/mistral/mistral_instruct_tokenizer_240216.model.v2",
              "tokenizers/mistral/mistral_instruct_tokenizer_240323.model.v3",
              "tokenizers/mistral/mistral_instruct_tokenizer_241114.model.v7"]
ODD_TEXTS = ["", " ", "  two  spaces ", "trailing\n\n", "tabs\t\tand\r\nreturns", "Ünïcödé ＡＢＣ ① 漢字 🙂",
             "3rd 12,345.50 0x1F", "\u200b zero width"]


def _real_texts():
  import gzip

  from tests import realdata
  with open(realdata.path("gsm8k/train.jsonl")) as f:
    gsm8k = [json.loads(line) for line, _ in zip(f, range(200))]
  with gzip.open(realdata.path("hh-rlhf/helpful-base_test.jsonl.gz"), "rt") as f:
    hh = [json.loads(line) for line, _ in zip(f, range(200))]
  return [r["question"] + "\n" + r["answer"] for r in gsm8k] + [r["chosen"] for r in hh] + ODD_TEXTS


@pytest.mark.parametrize("model", SPM_MODELS)
def test_sentencepiece_models_encode_and_decode_as_sentencepiece(model, tmp_path):
  sentencepiece = pytest.importorskip("sentencepiece")
  from tests import realdata
  path = realdata.path(model)
  (tmp_path / "tokenizer.model").write_bytes(open(path, "rb").read())
  ours, sp = jtok.load(str(tmp_path)), sentencepiece.SentencePieceProcessor(model_file=path)
  assert ours.vocab_size == sp.vocab_size()
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (sp.bos_id(), sp.eos_id(), sp.eos_id())  # no pad: eos
  for text in _real_texts():
    ids = ours.encode(text)   # nothing added around a bare model's encoding, as sentencepiece
    assert ids == sp.encode(text), text[:60]
    assert ours.decode(ids) == sp.decode(ids), text[:60]


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_trained_sentencepiece_models_equal_the_library(model_type):
  """Models trained here cover what the real ones do not: Unigram, the nmt_nfkc character map, extra-space removal;
  with byte fallback and digit splitting on and off. The parsed fields equal the library's own protobuf classes."""
  import io
  sentencepiece = pytest.importorskip("sentencepiece")
  from sentencepiece import sentencepiece_model_pb2

  from jalign.tokenizers import spm
  corpus = [f"Item {i}: {w} costs ${i * 3}.{i % 10}0, twice as much as {w}s did ({i}%)." for i in range(300)
            for w in ("apple", "pear", "Ünïcödé")]
  for extra in ({}, dict(byte_fallback=True, split_digits=True)):
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=out, vocab_size=300,
                                             model_type=model_type, minloglevel=2, **extra)
    sp = sentencepiece.SentencePieceProcessor(model_proto=out.getvalue())
    proto = sentencepiece_model_pb2.ModelProto.FromString(out.getvalue())
    parsed = spm.parse(out.getvalue())
    assert parsed.pieces == [(p.piece, pytest.approx(p.score), p.type) for p in proto.pieces]
    assert (parsed.model_type, parsed.byte_fallback, parsed.split_digits) == (
        proto.trainer_spec.model_type, proto.trainer_spec.byte_fallback, proto.trainer_spec.split_digits)
    assert parsed.charsmap == proto.normalizer_spec.precompiled_charsmap and parsed.charsmap  # nmt_nfkc
    tk, config = spm.to_tokenizer(parsed, "trained")
    assert config == {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    for text in corpus[::37] + ODD_TEXTS + ["never seen: zebra quartz 987654 ÆØÅ"]:
      assert tk.encode(text, add_special_tokens=False).ids == sp.encode(text), (extra, text)


def test_bad_sentencepiece_file_is_named(tmp_path):
  (tmp_path / "tokenizer.model").write_bytes(b"\x0a\xff\xff\xff\x0f")
  with pytest.raises(jtok.TokenizerError, match="tokenizer.model: not a SentencePiece model"):
    jtok.load(str(tmp_path))


def test_a_student_and_teacher_share_the_vocabulary_of_their_tokenizer_not_their_padded_rows(tmp_path):
  """Qwen3's tokenizer under two models padded to different row counts: the shared ids are the tokenizer's; a model
  with fewer rows than its tokenizer's tokens is not that tokenizer's."""
  from tests import realdata
  qwen = realdata.path("tokenizers/qwen3")
  tokens = Tokenizer.from_file(os.path.join(qwen, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
  tok = jtok.load(qwen)
  assert jtok.shared_vocabulary(tok, tok, student_rows=151936, teacher_rows=152064) == tokens
  with pytest.raises(jtok.TokenizerError, match=f"have {tokens} tokens, more than the student model's 1000 "):
    jtok.shared_vocabulary(tok, tok, student_rows=1000, teacher_rows=152064)


def test_different_tokenizers_name_the_first_id_that_differs():
  """Qwen3 and Llama 3 (both byte-level BPE, alike for their first ids): the error names both tokenizers and the
  first id whose tokens differ, as the tokenizers library itself reads them."""
  from tests import realdata
  qwen, llama = realdata.path("tokenizers/qwen3"), realdata.path("tokenizers/llama3")
  a, b = (Tokenizer.from_file(os.path.join(p, "tokenizer.json")) for p in (qwen, llama))
  first = next(i for i in range(200000) if a.id_to_token(i) != b.id_to_token(i))
  with pytest.raises(jtok.TokenizerError) as e:
    jtok.shared_vocabulary(jtok.load(qwen), jtok.load(llama), student_rows=151936, teacher_rows=128256)
  assert str(e.value).startswith(f"the student's tokenizer {qwen} and the teacher's {llama} differ at id {first}: "
                                 f"{a.id_to_token(first)!r} in the student's, {b.id_to_token(first)!r} in the "
                                 "teacher's; distillation compares"), str(e.value)


def test_a_token_the_student_lacks_is_named(hf_tokenizer_dirs, tmp_path):
  student_dir, teacher_dir = next(iter(hf_tokenizer_dirs.values()))[1], tmp_path / "teacher"
  tk = Tokenizer.from_file(os.path.join(student_dir, "tokenizer.json"))
  tk.add_tokens(["<extra_tool>"])  # a teacher whose tokenizer has one token more
  os.makedirs(teacher_dir)
  tk.save(str(teacher_dir / "tokenizer.json"))
  with open(os.path.join(student_dir, "tokenizer_config.json")) as f:
    (teacher_dir / "tokenizer_config.json").write_text(f.read())
  student, teacher = jtok.load(student_dir), jtok.load(str(teacher_dir))
  n = student.vocab_size
  with pytest.raises(jtok.TokenizerError, match=f"differ at id {n}: no token in the student's, '<extra_tool>' in "
                                                "the teacher's"):
    jtok.shared_vocabulary(student, teacher, student_rows=n, teacher_rows=n + 1)
