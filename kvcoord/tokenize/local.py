"""A local Hugging Face tokenizer directory, used the way vLLM 0.33's OpenAI server uses it.

Loading: ``AutoTokenizer.from_pretrained(dir, truncation_side="left")`` offline (``HF_HUB_OFFLINE=1`` and
``local_files_only=True``: nothing is ever downloaded), as ``vllm/tokenizers/registry.py`` does for a
generative model. Completions: ``tok(prompt, add_special_tokens=...)``. Chats: the messages normalised as
vLLM does (:mod:`kvcoord.tokenize.chat`), ``apply_chat_template(..., tokenize=False)``, then the text
encoded with the request's ``add_special_tokens`` (default False: the template writes BOS itself).

The ids depend on the transformers release, so the ``tokenize`` extra pins the fleet's range. Directories
vLLM renders with another code path (mistral_common, Harmony, its own DeepSeek/Kimi/… renderers, a
multimodal processor's template) are refused rather than approximated.

The work is synchronous and CPU-bound (a ~2k-token chat takes a few ms): the async methods run it in a
worker thread (a short prompt inline: :func:`~kvcoord.tokenize.base.encode_by_size`); the ``_sync`` twins
are for callers already off the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvcoord.tokenize.base import (
    ChatTemplateContentFormat,
    InvalidChat,
    Message,
    NamedTokenizer,
    TokenizeError,
    Tool,
    check_chat_request,
    encode_by_size,
)
from kvcoord.tokenize.chat import consolidate_developer, dump_tools, normalize_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LocalTokenizer", "check_directory", "merge_kwargs"]

INSTALL_HINT = "transformers is not installed: pip install 'kvcoord[tokenize]'"

# vLLM 0.33 picks a non-HF renderer for these (config/model.py, the "auto" tokenizer mode; online_renderer's
# Harmony switch): their chats are not rendered by the HF chat template.
_OWN_RENDERER_ARCHS = frozenset({
    "Alpamayo2Super", "MoonshotKimiaForCausalLM", "KimiK3ForConditionalGeneration", "DeepseekV32ForCausalLM",
    "DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration", "DeepseekV41ForCausalLM",
    "InklingForCausalLM", "InklingForConditionalGeneration",
})
_OWN_RENDERER_TYPES = frozenset({"gpt_oss"})
# vLLM loads these with the generic TokenizersBackend, bypassing their hub tokenizer_class (registry.py).
_GENERIC_BACKEND_TYPES = frozenset({"internlm2", "step3_vl", "step3p7", "step5", "step5_vl", "unlimited-ocr",
                                    "unlimited_ocr"})
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
_UNSET = (None, "auto")


def merge_kwargs(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: ``overrides`` win, except their None and "auto" values, which are unset."""
    out = dict(defaults or {})
    out.update((k, v) for k, v in (overrides or {}).items() if not any(v is u or v == u for u in _UNSET))
    return out


def _import_transformers(model: str, source: str) -> Any:
    """transformers, imported offline and quietly on first use (it takes 1-2 s and is an optional extra)."""
    if "transformers" not in sys.modules:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # the "PyTorch was not found" banner
    try:
        import transformers
    except ImportError as exc:
        raise TokenizeError(model, f"{INSTALL_HINT} ({exc})", source=source) from exc
    return transformers


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _refusal(path: Path, chat_template: str | None) -> str | None:
    """Why vLLM would not render this directory's chats with transformers' chat template, if it would not."""
    if (path / "tekken.json").is_file() or any(path.glob("tokenizer.model.v*")):
        return "a Mistral tokenizer (tekken.json / tokenizer.model.v*): vLLM uses mistral_common for it"
    config = _read_json(path / "config.json") or {}
    archs = config.get("architectures") or []
    own = [a for a in archs if isinstance(a, str) and a in _OWN_RENDERER_ARCHS]
    if own or config.get("model_type") in _OWN_RENDERER_TYPES:
        what = own[0] if own else config.get("model_type")
        return f"vLLM renders {what} chats with its own renderer, not the HF chat template"
    if chat_template is None and any((path / f).is_file() for f in _PROCESSOR_FILES):
        return ("a multimodal processor config: vLLM may take the processor's chat template; "
                "configure chat_template explicitly")
    return None


def _load_template_option(model: str, source: str, chat_template: str | None) -> str | None:
    """vLLM's ``--chat-template``: a file to read, else (if it looks like Jinja) the template itself."""
    if chat_template is None:
        return None
    try:
        return Path(chat_template).expanduser().read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        if not any(c in chat_template for c in "{}\n"):
            raise TokenizeError(model, f"chat template file {chat_template!r} cannot be read: {exc}",
                                source=source) from exc
    return chat_template


def _error_reason(exc: BaseException) -> str:
    """The most specific reason in an exception chain: the template's own message when it raised."""
    import jinja2

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return f"chat template: {current}"
        current = current.__cause__ or current.__context__
    return f"{type(exc).__name__}: {exc}"



def check_directory(model: str, directory: str | os.PathLike[str]) -> None:
    """Raise :class:`TokenizeError` unless ``directory`` looks like a tokenizer directory: the cheap part
    of :meth:`LocalTokenizer.load`, which the coordinator runs on its configuration so that a wrong path
    is refused at start, not at the first lookup."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise TokenizeError(model, "not a directory (expected a local tokenizer directory or an "
                            "http(s):// engine URL; nothing is downloaded)", source=str(path))
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise TokenizeError(model, "no tokenizer.json or tokenizer_config.json in it", source=str(path))


class LocalTokenizer(NamedTokenizer):
    """A Hugging Face tokenizer directory on this machine, producing vLLM 0.33's token ids.

    ``chat_template``, ``chat_template_content_format`` and ``default_chat_template_kwargs`` mirror the
    engine's ``--chat-template``, ``--chat-template-content-format`` and ``--default-chat-template-kwargs``:
    set them as the fleet does, or the ids differ. Encoding holds a per-tokenizer lock (transformers'
    tokenizer object is not safe to share between threads mid-call).
    """

    def __init__(
        self,
        model: str,
        source: str,
        hf_tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str | None = None,
        chat_template_content_format: ChatTemplateContentFormat = "auto",
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(model, source)
        self._hf = hf_tokenizer
        self._chat_template = chat_template
        self._content_format: ChatTemplateContentFormat = chat_template_content_format
        self._defaults = dict(default_chat_template_kwargs or {})
        self._lock = threading.Lock()
        from transformers import PythonBackend

        # resolve_chat_template_kwargs: the renderer's own parameters always pass the kwargs filter.
        self._call_params = frozenset(
            p.name
            for fn in (hf_tokenizer.apply_chat_template, PythonBackend.apply_chat_template)
            for p in inspect.signature(fn).parameters.values()
            if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        )

    @classmethod
    def load(
        cls,
        model: str,
        directory: str | os.PathLike[str],
        *,
        chat_template: str | None = None,
        chat_template_content_format: ChatTemplateContentFormat = "auto",
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> LocalTokenizer:
        """Load ``directory`` (tokenizer.json, tokenizer_config.json, chat_template.jinja…): takes seconds."""
        path = Path(directory).expanduser()
        source = str(path)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise TokenizeError(
                model, f"bad chat_template_content_format {chat_template_content_format!r}", source=source)
        check_directory(model, path)
        template = _load_template_option(model, source, chat_template)
        if (why := _refusal(path, template)) is not None:
            raise TokenizeError(model, f"not supported: {why}", source=source)
        transformers = _import_transformers(model, source)
        loader: Any = transformers.AutoTokenizer
        if (_read_json(path / "config.json") or {}).get("model_type") in _GENERIC_BACKEND_TYPES:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            loader = TokenizersBackend
        try:
            hf = loader.from_pretrained(source, truncation_side="left", local_files_only=True,
                                        trust_remote_code=False)
        except Exception as exc:
            raise TokenizeError(model, f"cannot load the tokenizer: {type(exc).__name__}: {exc}",
                                source=source) from exc
        if not isinstance(hf, transformers.PreTrainedTokenizerBase):
            raise TokenizeError(model, f"loaded a {type(hf).__name__}, not a tokenizer", source=source)
        return cls(model, source, hf, chat_template=template,
                   chat_template_content_format=chat_template_content_format,
                   default_chat_template_kwargs=default_chat_template_kwargs)

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer behind this one (for inspection; do not call it concurrently)."""
        return self._hf

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            with self._lock:
                ids = self._hf(text, add_special_tokens=add_special_tokens)["input_ids"]
        except Exception as exc:
            raise self._error(f"encoding failed: {type(exc).__name__}: {exc}", bad_request=False) from exc
        return [int(i) for i in ids]

    def encode_prompt_sync(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """``/v1/completions``, string prompt: ``tok(prompt, add_special_tokens=...)`` (default True)."""
        self._check_prompt(prompt)
        return self._encode(prompt, add_special_tokens)

    def _template_call(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation and the ``apply_chat_template`` kwargs vLLM's chat route would use."""
        checked = check_chat_request(messages, tools, add_generation_prompt, continue_final_message,
                                     chat_template_kwargs)
        if chat_template_kwargs and chat_template_kwargs.get("chat_template") is not None:
            raise InvalidChat("a chat template passed with the request is refused "
                              "(vLLM does so without --trust-request-chat-template)")
        # online_renderer.preprocess_chat: server defaults < {tools, tokenize} < the request's kwargs
        # < {add_generation_prompt, continue_final_message}; then the resolved template and return_dict.
        defaults = merge_kwargs(self._defaults, {"tools": None if tools is None else dump_tools(tools),
                                                 "tokenize": False})
        request = merge_kwargs(chat_template_kwargs, {"add_generation_prompt": add_generation_prompt,
                                                      "continue_final_message": continue_final_message})
        kwargs = merge_kwargs(merge_kwargs(defaults, request),
                              {"chat_template": self._chat_template, "return_dict": False})
        try:
            template = self._hf.get_chat_template(kwargs.pop("chat_template", None), kwargs.get("tools"))
        except ValueError as exc:
            raise self._error(f"no chat template: {exc}", bad_request=False) from exc
        if self._content_format == "auto":
            from kvcoord.tokenize.template import detect_content_format

            content_format: Literal["string", "openai"] = detect_content_format(template)
        else:
            content_format = self._content_format
        conversation = normalize_messages(checked, content_format)
        from kvcoord.tokenize.template import supports_developer_role, template_variables

        if any(m["role"] == "developer" for m in conversation) and not supports_developer_role(template):
            conversation = consolidate_developer(conversation)
        try:
            accepted = template_variables(template) | self._call_params
        except Exception as exc:
            raise self._error(f"chat template does not parse: {_error_reason(exc)}",
                              bad_request=False) from exc
        call = {"tools": kwargs.pop("tools", None), "chat_template": template,
                "tokenize": bool(kwargs.pop("tokenize", False))}
        call.update((k, v) for k, v in kwargs.items() if k in accepted and k not in call)
        return conversation, call

    def _apply(self, conversation: list[dict[str, Any]], call: dict[str, Any]) -> str | list[int]:
        try:
            if call["tokenize"]:  # a request that sets chat_template_kwargs.tokenize: transformers encodes
                with self._lock:
                    out = self._hf.apply_chat_template(conversation, **call)
            else:
                out = self._hf.apply_chat_template(conversation, **call)
        except Exception as exc:
            raise self._error(f"rendering failed: {_error_reason(exc)}", bad_request=True) from exc
        if isinstance(out, str):
            return out
        if isinstance(out, list) and all(isinstance(i, int) for i in out):
            return [i for i in out if isinstance(i, int)]
        raise self._error(f"the chat template returned a {type(out).__name__}", bad_request=False)

    def _render(
        self, messages: Sequence[Message], tools: Sequence[Tool] | None, add_generation_prompt: bool,
        continue_final_message: bool, chat_template_kwargs: Mapping[str, Any] | None, *, ids: bool,
    ) -> str | list[int]:
        """The chat rendered (as ids only where ``ids`` and the request's kwargs ask transformers to
        encode), a chat vLLM refuses as a bad request."""
        try:
            conversation, call = self._template_call(messages, tools, add_generation_prompt,
                                                     continue_final_message, chat_template_kwargs)
        except InvalidChat as exc:
            raise self._error(str(exc), bad_request=True) from exc
        return self._apply(conversation, call if ids else {**call, "tokenize": False})

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM renders for this chat (before encoding)."""
        out = self._render(messages, tools, add_generation_prompt, continue_final_message,
                           chat_template_kwargs, ids=False)
        assert isinstance(out, str)
        return out

    def encode_chat_sync(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """``/v1/chat/completions``: the rendered text encoded with ``add_special_tokens`` (default False)."""
        out = self._render(messages, tools, add_generation_prompt, continue_final_message,
                           chat_template_kwargs, ids=True)
        return out if isinstance(out, list) else self._encode(out, add_special_tokens)

    async def encode_prompt(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode_prompt_sync`; a long prompt (milliseconds of encoding) in a worker thread, so the
        event loop keeps serving lookups meanwhile."""
        return await encode_by_size(self.encode_prompt_sync, prompt, add_special_tokens)

    async def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """:meth:`encode_chat_sync` in a worker thread (rendering a template and encoding it takes
        milliseconds), so the event loop keeps serving lookups meanwhile."""
        return await asyncio.to_thread(
            self.encode_chat_sync, messages, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
            add_special_tokens=add_special_tokens)

    async def aclose(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return f"LocalTokenizer(model={self._model!r}, source={self._source!r}, {type(self._hf).__name__})"
