"""Lookup bodies against an :class:`~aio_mclookup.SGLangLayout`: token ids (their pages hashed
by the coordinator's ``lookup_tokens``, with the body's ``extra_key`` and ``cache_salt``; ids
that make wide or refused pages hashed, or refused, here with the layout's ``page_hashes``), or
the prompt's page hashes as given, checked (widths, counts, vLLM-only fields) before any lookup
starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import InvalidRequest, SGLangLayout
from .._hashing.sglang import namespace_seed, narrow_token_ids
from ._decode import (
    _decode_hashes,
    _decode_token_ids,
    _form,
    _int_field,
    _Item,
    _kind,
    _name,
    _parse_json,
    _text_field,
)
from ._errors import _field_loc, _invalid
from ._models import _MAX_TOKENS, Loc, LookupRequest
from ._scan import scan_hex_lookup

__all__ = ["SGLangDecoder", "layout_info"]

_VLLM_ONLY = {
    "token_len": "token_len is vLLM's plain prefix hit; SGLang's hit is for num_tokens",
    "lora_name": "lora_name is vLLM's; for SGLang append the LoRA id to extra_key",
    "lora_path": "lora_path is vLLM's; for SGLang append the LoRA id to extra_key",
    "mm_features": "mm_features are vLLM's; SGLang's multimodal pages are not reproduced",
}
"""Body fields that do not apply to an SGLang layout, and why (the 422's message)."""

_KNOWN = frozenset(LookupRequest.model_fields)

_PAGE_HASH_BYTES = 32


class SGLangDecoder:
    """Turns one lookup body into an :class:`_Item` for an SGLang layout; raises
    :class:`~._errors.ApiError` (422 naming the field, 413 over a limit)."""

    def __init__(self, max_hashes: int) -> None:
        self.max_hashes = max_hashes

    def body(self, body: bytes, loc: Loc, layout: SGLangLayout) -> _Item:
        """The item of a whole JSON body: the common ``num_tokens`` + hex ``block_hashes``
        shape read without a parse (as for vLLM), anything else parsed."""
        found = scan_hex_lookup(body, self.max_hashes)
        if found is not None and found[0] == "num_tokens":
            _, value, rows = found
            num_tokens = _int_field({"num_tokens": value}, "num_tokens", loc, 0, _MAX_TOKENS)
            assert num_tokens is not None
            return self.checked(_Item(None, num_tokens, rows, "block_hashes"), loc, layout)
        return self.item(_parse_json(body), loc, layout)

    def item(self, raw: object, loc: Loc, layout: SGLangLayout) -> _Item:
        """The item of one parsed lookup (a body, or one of a batch's ``requests``)."""
        if type(raw) is not dict:
            raise _invalid(loc, f"a lookup must be an object, not {_kind(raw)}")
        for key, value in raw.items():
            if key not in _KNOWN:
                raise _invalid([*loc, _name(key)], "unknown field")
            if key in _VLLM_ONLY and value is not None:
                raise _invalid([*loc, key], f"{_VLLM_ONLY[key]} (this server's layout is SGLang)")
        form = _form(raw, loc)
        if form == "token_ids":
            return self._tokens(raw, loc, layout)
        for name in ("extra_key", "cache_salt"):
            if raw.get(name) is not None:
                raise _invalid([*loc, name], f"{name} goes with token_ids only")
        num_tokens = _int_field(raw, "num_tokens", loc, 0, _MAX_TOKENS)
        if num_tokens is None:
            raise _invalid([*loc, "num_tokens"], "give num_tokens with page hashes")
        decoded = _decode_hashes(raw, form, loc, self.max_hashes)
        return self.checked(_Item(None, num_tokens, decoded, form), loc, layout)

    @staticmethod
    def checked(item: _Item, loc: Loc, layout: SGLangLayout) -> _Item:
        """``item`` once its page hashes are 32 bytes each and cover the pages its
        ``num_tokens`` probes (what planning would refuse, refused before any lookup)."""
        hashes: Any = item.hashes
        if hasattr(hashes, "shape"):
            widths = {int(hashes.shape[1])} if len(hashes) else set()
        else:
            widths = {len(h) for h in hashes}
        if widths - {_PAGE_HASH_BYTES}:
            raise _invalid(
                [*loc, item.source],
                f"SGLang page hashes are {_PAGE_HASH_BYTES} bytes (SHA-256), not "
                f"{min(widths - {_PAGE_HASH_BYTES})}",
            )
        pages = layout.query_pages(item.num_tokens)
        probed = pages if pages * layout.page_size >= layout.prefetch_threshold else 0
        if len(hashes) < probed:
            raise _invalid(
                [*loc, item.source],
                f"{len(hashes)} page hashes; a request of {item.num_tokens} tokens probes "
                f"{probed} pages of {layout.page_size} tokens: give the whole prompt's",
            )
        return item

    def _tokens(self, raw: Mapping[str, Any], loc: Loc, layout: SGLangLayout) -> _Item:
        if raw.get("hash_len") is not None:
            raise _invalid([*loc, "hash_len"], "hash_len goes with block_hashes_b64 only")
        page = layout.page_size
        limit = self.max_hashes * page + page - (0 if layout.eagle else 1)
        ids = _decode_token_ids(raw["token_ids"], loc, limit)
        num_tokens = _int_field(raw, "num_tokens", loc, 0, _MAX_TOKENS)
        if num_tokens is not None and num_tokens != len(ids):
            raise _invalid([*loc, "num_tokens"], "num_tokens must equal len(token_ids)")
        extra_key = _text_field(raw, "extra_key", loc)
        cache_salt = _text_field(raw, "cache_salt", loc)
        try:
            namespace_seed(extra_key, cache_salt)  # (a bad one refused here, not in a lookup)
            narrow = narrow_token_ids(ids)
            if narrow is not None:  # (no page refused or wide: the coordinator hashes them,
                item = _Item(None, len(ids), [], "token_ids")  # off its loop)
                item.tokens = np.frombuffer(narrow[0], dtype="<u4")
                item.extra_key, item.cache_salt = extra_key, cache_salt
                return item
            hashes = layout.page_hashes(ids, extra_key=extra_key, cache_salt=cache_salt)
        except InvalidRequest as exc:
            parts = _field_loc(exc.field, "token_ids") if exc.field else ["token_ids"]
            raise _invalid([*loc, *parts], str(exc)) from exc
        return _Item(None, len(ids), hashes, "token_ids")


def layout_info(layout: SGLangLayout) -> dict[str, Any]:
    """What ``GET /v1/layout`` says of the page hashing of token-id bodies."""
    return {
        "engine": "sglang",
        "algo": "sha256",
        "page_size": layout.page_size,
        "eagle": layout.eagle,
        "sglang_version": layout.sglang_version,
        "namespace": "extra_key, cache_salt" if layout.sglang_version != "0.5.17" else None,
    }
