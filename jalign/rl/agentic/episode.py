"""A multi-turn episode as one token sequence, token in and token out: the prompt's ids as the chat template renders
them, then turn by turn the model's own sampled ids (loss mask 1, kept exactly as sampled, never re-tokenised) and
the ids the template puts between turns (the end of the model's turn, the tool messages, the next generation
prompt; loss mask 0), taken as the difference between the template's rendering of the conversation with and without
the new messages. The ids so built equal the template's rendering of the whole conversation, so the tokens trained on
are the tokens sampled."""
from __future__ import annotations

from jalign.core.errors import UserError
from jalign.tokenizers.tokenizer import ChatTemplateError


class EpisodeError(UserError):
  """The chat template renders an earlier part of the conversation differently once it goes on (it rewrites past
  turns), so the episode's tokens cannot be extended without re-tokenising."""


class Episode:
  def __init__(self, tok, messages: list[dict], **render_kwargs):
    self.tok, self.kwargs = tok, render_kwargs
    self.messages = [dict(m) for m in messages]
    self.text = tok.render_chat(self.messages, add_generation_prompt=True, **render_kwargs)
    self.ids = tok.encode(self.text, add_special_tokens=False)
    self.loss_mask = [0] * len(self.ids)
    self.prompt_length = len(self.ids)
    self.model_turns = 0

  def add_model_turn(self, ids: list[int], content: str) -> None:
    """The model's sampled ids (with the stop token that ended them) and the message content they stand for (the
    decoded text without the stop token)."""
    ids = [int(i) for i in ids]
    if content.startswith(" ") and self._renders_as(content[1:], ids):
      content = content[1:]  # the space is the template's (Mistral's ' ' before an answer), decoded with the turn
    self.ids += ids
    self.loss_mask += [1] * len(ids)
    self.text += self.tok.decode(ids, skip_special_tokens=False)
    self.messages.append({"role": "assistant", "content": content})
    self.model_turns += 1

  def _renders_as(self, content: str, ids: list[int]) -> bool:
    """Whether the template renders an assistant turn `content` after the conversation as `ids`."""
    try:
      text = self.tok.render_chat(self.messages + [{"role": "assistant", "content": content}], **self.kwargs)
    except ChatTemplateError:
      return False
    rendered = self.tok.encode(text, add_special_tokens=False)
    return rendered[:len(self.ids)] == self.ids and rendered[len(self.ids):len(self.ids) + len(ids)] == ids

  def set_model_message(self, message: dict) -> None:
    """Writes the last model turn into the conversation as `message` (structured tool calls) instead of its text;
    the next observation checks that the template renders it as the tokens sampled."""
    self.messages[-1] = dict(message)

  def add_observation(self, messages: list[dict]) -> None:
    """The environment's messages and the next generation prompt, as the template renders them after the turns so
    far."""
    self.messages += [dict(m) for m in messages]
    try:
      full = self.tok.render_chat(self.messages, add_generation_prompt=True, **self.kwargs)
    except ChatTemplateError as e:
      raise EpisodeError(f"turn {self.model_turns}: the chat template refuses the conversation: {e}") from None
    if full.startswith(self.text):
      delta = self.tok.encode(full[len(self.text):], add_special_tokens=False)
    else:
      # The decoded text differs, but the template's rendering may still encode to the sampled ids: SentencePiece
      # tokenizers do not decode to the text they encode (Mistral's "[TOOL_CALLS] [" encodes with the dummy-prefix
      # space, which a decode shows twice), and structured tool calls are rendered by the template, not decoded.
      full_ids = self.tok.encode(full, add_special_tokens=False)
      if full_ids[:len(self.ids)] != self.ids:
        at = next((i for i, (a, b) in enumerate(zip(full, self.text)) if a != b), min(len(full), len(self.text)))
        raise EpisodeError(f"turn {self.model_turns}: the chat template renders the conversation so far differently "
                           f"once it goes on (from character {at}: {self.text[at:at + 40]!r} becomes "
                           f"{full[at:at + 40]!r}); the sampled tokens cannot be kept as they are. A model turn must "
                           "end with the template's end-of-turn token and be rendered verbatim by the template")
      delta = full_ids[len(self.ids):]
    self.ids += delta
    self.loss_mask += [0] * len(delta)
    self.text = full

  def add_observation_ids(self, ids: list[int]) -> None:
    """An environment's own ids (its observation and the next turn's opening), appended as they are; such an
    environment formats every turn itself (a later message observation would not render them)."""
    ids = [int(i) for i in ids]
    self.ids += ids
    self.loss_mask += [0] * len(ids)
    self.text += self.tok.decode(ids, skip_special_tokens=False)

  @property
  def response_ids(self) -> list[int]:
    """Everything after the prompt: model turns and observations."""
    return self.ids[self.prompt_length:]

  @property
  def response_mask(self) -> list[int]:
    return self.loss_mask[self.prompt_length:]
