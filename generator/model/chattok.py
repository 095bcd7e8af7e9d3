"""A saved tokenizer served by the ``tokenizers`` library and jinja2 alone: encode, decode and the chat
template as transformers' ``TokenizersBackend`` does them, without importing transformers.

Importing transformers costs every generator ~1.1 s of its start (its ``__init__`` scans every one of
its ~570 modules for their ``__all__``, then checks its dependencies' versions) for a tokenizer whose
work is the Rust library's. The directory is the one transformers saved (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``); ``tests/test_gguf.py`` checks the answers equal
``TokenizersBackend``'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["SavedTokenizer"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class SavedTokenizer:
    """``tokenizer.json`` with the special tokens and chat template saved beside it."""

    def __init__(self, backend: Any, config: Mapping[str, Any], chat_template: str | None) -> None:
        self.backend = backend  # tokenizers.Tokenizer
        self.special_tokens_map = {k: str(config[k]) for k in _SPECIAL if isinstance(config.get(k), str)}
        self.chat_template = chat_template

    @classmethod
    def load(cls, src: Path) -> SavedTokenizer:
        from tokenizers import Tokenizer

        config = json.loads((src / "tokenizer_config.json").read_text())
        template_file = src / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        return cls(Tokenizer.from_file(str(src / "tokenizer.json")), config,
                   template if isinstance(template, str) else None)

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        # transformers cleans up tokenization spaces only when asked, and never for a BPE model.
        return str(self.backend.decode([ids] if isinstance(ids, int) else list(ids),
                                       skip_special_tokens=skip_special_tokens))

    @cached_property
    def _template(self) -> Any:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            # transformers' own filter: jinja's escapes HTML characters
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return env.from_string(self.chat_template)

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs: Any) -> Any:
        """The conversation rendered by its template (the special tokens as variables), tokenized without
        adding special tokens (the template has them): a dict with ``input_ids``, or the ids
        (``return_dict=False``), or the text (``tokenize=False``)."""
        text = self._template.render(messages=[dict(m) for m in conversation], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        return self(text, add_special_tokens=False) if return_dict else self.encode(text, add_special_tokens=False)
