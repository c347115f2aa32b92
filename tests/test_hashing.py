"""BlockHasher: vLLM-exact block hashes (token ids -> request.block_hashes).

Checked against: the public vectors produced by the real vLLM releases; a straightforward
per-block implementation of the recipe written here (``reference_hashes``); pickle.dumps and
cbor2.dumps for the payload encoder, over every integer range; and the error contract.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import aio_mclookup
from aio_mclookup import BlockHasher, InvalidRequest
from aio_mclookup._hashing import MAX_TOKENS, _payload
from aio_mclookup._hashing._inputs import fresh

VECTORS = Path("/work/shared/conformance/hashes-public.jsonl")
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
         2**39 - 1, 2**39, 2**47 - 1, 2**47, 2**55 - 1, 2**55, 2**63 - 1]
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------ reference
def distinct(text: str) -> str:
    """An equal string that is a new object (as vLLM's decoded strings are)."""
    return (text + "\x00")[:-1]


def digest_fn(algo: str):
    if algo.startswith("sha256"):
        return lambda data: hashlib.sha256(data).digest()
    import xxhash

    return xxhash.xxh3_128_digest


def serialize_fn(algo: str):
    if algo.endswith("_cbor"):
        return lambda obj: cbor2.dumps(obj, canonical=True)
    return lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def reference_hashes(
    tokens: Sequence[int],
    block: int,
    algo: str = "sha256",
    seed: str | None = "0",
    version: str = "0.33.0",
    *,
    lora: tuple[str, str] | None = None,
    salt: str | None = None,
    mm: Sequence[tuple[str, int, int]] = (),
    embeds: np.ndarray | None = None,
    lookahead: int = 0,
) -> list[bytes]:
    """The recipe, block by block, as vLLM's code does it (docs/block-hashing.md, 1.2-1.6)."""
    fn = lambda obj: digest_fn(algo)(serialize_fn(algo)(obj))  # noqa: E731
    minor = int(version.split(".")[1])
    tagged = minor >= 31
    parent = fn("vllm-none-hash" if seed is None else seed)
    ids = [int(t) for t in tokens]
    out = []
    for start in range(0, len(ids) - lookahead - block + 1, block):
        end = start + block
        stop = end + lookahead
        keys: list[object] = []
        if lora:
            keys.append(("lora", distinct(lora[0]), distinct(lora[1])) if tagged
                        else distinct(lora[0]))
        for ident, offset, length in mm:
            if offset < stop and offset + length > start:
                keys.append(("mm", distinct(ident), offset - start) if tagged
                            else (distinct(ident), offset - start))
        if salt and start == 0:
            keys.append(("cache_salt", distinct(salt)) if tagged else distinct(salt))
        if embeds is not None:
            d = hashlib.sha256(np.ascontiguousarray(embeds[start:stop]).tobytes()).digest()
            keys.append(("prompt_embeds", d) if tagged else d)
        extra: object = tuple(keys) if keys else None
        if lookahead:
            extra = (extra, *ids[end:stop])
        parent = fn((parent, tuple(ids[start:end]), extra))
        out.append(parent)
    return out


def rows(arr: np.ndarray) -> list[bytes]:
    assert arr.dtype == np.uint8 and arr.ndim == 2
    return [bytes(r) for r in arr]


# ------------------------------------------------------------------------------ vectors
def _vectors() -> list[dict[str, Any]]:
    if not VECTORS.exists():  # pragma: no cover - the shared checkout is absent
        return []
    return [json.loads(line) for line in VECTORS.read_text().splitlines() if line.strip()]


@pytest.mark.skipif(not VECTORS.exists(), reason="public vectors not available")
@pytest.mark.parametrize("vec", _vectors(), ids=lambda v: v["id"])
def test_public_vectors(vec: dict[str, Any]) -> None:
    hasher = BlockHasher(vec["block_size"], algo=vec["algo"], seed=vec["seed"],
                         vllm_version=vec["vllm_version"])
    assert hasher.none_hash.hex() == vec["none_hash_hex"]
    e = vec.get("extra") or {}
    kw: dict[str, Any] = {k: e[k] for k in ("lora_name", "lora_path", "cache_salt")
                          if e.get(k) is not None}
    if e.get("mm_features"):
        kw["mm_features"] = [(m["identifier"], m["offset"], m["length"])
                             for m in e["mm_features"]]
    if e.get("prompt_embeds"):
        pe = e["prompt_embeds"]
        kw["prompt_embeds"] = np.frombuffer(bytes.fromhex(pe["data_hex"]),
                                            dtype=pe["dtype"]).reshape(pe["shape"])
    if e.get("lookahead_tokens"):
        kw["lookahead_tokens"] = e["lookahead_tokens"]
    want = vec["expected_block_hashes_hex"]
    assert [r.hex() for r in rows(hasher.hash(vec["token_ids"], **kw))] == want
    arr = np.asarray(vec["token_ids"], dtype=np.int64)
    assert [r.hex() for r in rows(hasher.hash(arr, **kw))] == want


def test_reference_none_hashes_from_the_doc() -> None:
    assert BlockHasher(16).none_hash.hex().startswith("066b1e89")
    assert BlockHasher(16).none_hash.hex().endswith("0d71198")
    assert BlockHasher(16, algo="sha256_cbor").none_hash.hex().startswith("9bd96a48")
    assert BlockHasher(16, seed="0").none_hash.hex().startswith("1973e238")
    # the text is hashed: "042" is not "42", and "random" is a deterministic word
    assert BlockHasher(16, seed="042").none_hash != BlockHasher(16, seed="42").none_hash
    assert BlockHasher(16, seed="random").none_hash == BlockHasher(4, seed="random").none_hash
    assert BlockHasher(16, algo="xxhash", seed="0").none_hash == (
        digest_fn("xxhash")(pickle.dumps("0", protocol=5)))


# ------------------------------------------------------------------------------ payloads
tokens_st = st.one_of(
    st.integers(0, 300), st.integers(0, 70_000), st.integers(0, 2**33),
    st.integers(0, 2**63 - 1), st.sampled_from(EDGES),
    st.sampled_from(EDGES).map(lambda x: max(x - 1, 0)),
)
extra_st = st.one_of(
    st.none(),
    st.tuples(st.text(max_size=12)),
    st.tuples(st.tuples(st.just("mm"), st.text(min_size=2, max_size=8),
                        st.integers(-2**40, 2**40))),
    st.tuples(st.binary(min_size=32, max_size=32), st.integers(0, 2**63 - 1)),
)


def _check_payloads(ids: list[int], block: int, width: int, cbor: bool,
                    extras: list[object] | None) -> None:
    n_blocks = len(ids) // block
    arr = np.array(ids, dtype=np.uint64)
    if extras is None:
        slots: list[object] = [None] * n_blocks
        encoded: bytes | list[bytes] = _payload.extra_encoding(None, width, cbor)
    else:
        slots = extras
        encoded = [_payload.extra_encoding(x, width, cbor) for x in extras]
    built = _payload.build(arr, block, width, cbor, encoded)
    assert built is not None
    assert len(built.heads) == len(built.bodies) == n_blocks
    parent = bytes(range(width))
    ser = serialize_fn("sha256_cbor" if cbor else "sha256")
    for b in range(n_blocks):
        want = ser((parent, tuple(ids[b * block:(b + 1) * block]), slots[b]))
        assert built.heads[b] + parent + built.bodies[b] == want, (b, ids, block)


@SETTINGS
@given(ids=st.lists(tokens_st, max_size=120), block=st.integers(1, 40),
       width=st.sampled_from([16, 32]), cbor=st.booleans())
@example(ids=EDGES * 2, block=1, width=32, cbor=False)
@example(ids=EDGES * 2, block=3, width=16, cbor=True)
@example(ids=list(range(250, 262)) * 3, block=4, width=32, cbor=False)
@example(ids=[0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1] * 3, block=2, width=32, cbor=True)
@example(ids=[0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1] * 3, block=5, width=16, cbor=False)
@example(ids=[2**32 - 1, 2**31 - 1, 0, 2**32 - 1], block=2, width=32, cbor=True)
def test_payload_encoding_matches_pickle_and_cbor(ids: list[int], block: int, width: int,
                                                  cbor: bool) -> None:
    _check_payloads(ids, block, width, cbor, None)


@SETTINGS
@given(data=st.data(), block=st.integers(1, 12), width=st.sampled_from([16, 32]),
       cbor=st.booleans())
def test_payload_encoding_with_per_block_extras(data: st.DataObject, block: int, width: int,
                                                cbor: bool) -> None:
    ids = data.draw(st.lists(tokens_st, min_size=block, max_size=60))
    extras = [data.draw(extra_st) for _ in range(len(ids) // block)]
    _check_payloads(ids, block, width, cbor, extras)


@pytest.mark.parametrize("cbor", [False, True])
def test_every_range_boundary_one_block_each(cbor: bool) -> None:
    ids = sorted({max(v + d, 0) for v in EDGES for d in (-1, 0, 1) if v + d < 2**63})
    _check_payloads(ids, 1, 32, cbor, None)
    _check_payloads(ids, 7, 32, cbor, None)
    _check_payloads(ids, len(ids), 16, cbor, None)


def test_in_order_probe_and_fallback_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _payload._IN_ORDER  # numpy assigns a 1-D index in order
    monkeypatch.setattr(_payload, "_IN_ORDER", False)
    rng = np.random.default_rng(3)
    ids = rng.choice(EDGES, size=300).tolist() + rng.integers(0, 70_000, 300).tolist()
    _check_payloads(ids, 5, 32, False, None)
    _check_payloads(ids, 3, 16, True, None)


def test_huge_pickle_frames_fall_back_to_the_per_block_path() -> None:
    # 20,000 BININT records (5 bytes) per block: the frame passes 64 KiB, pickle splits it
    ids = [2**31 - 1 - i for i in range(40_000)]
    assert _payload.build(np.array(ids, dtype=np.uint64), 20_000, 32, False,
                          _payload.extra_encoding(None, 32, False)) is None
    got = rows(BlockHasher(20_000, seed="0").hash(ids))
    assert got == reference_hashes(ids, 20_000)
    assert len(got) == 2


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_bodies_longer_than_the_struct_table(algo: str) -> None:
    # 1,500 ids of 4-5 bytes: each body is over 4 KiB, cut by slicing instead of struct
    rng = np.random.default_rng(2)
    ids = rng.integers(2**17, 2**31 - 1, 4_500).tolist()
    hasher = BlockHasher(1_500, algo=algo, seed="0")
    assert rows(hasher.hash(ids)) == reference_hashes(ids, 1_500, algo, "0")


# ------------------------------------------------------------------------------ the chain
mm_st = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 9),
                           st.sampled_from(["img-a", "img-b", "x", "ffff"])), max_size=6)


def _layout(items: list[tuple[int, int, str]]) -> list[tuple[str, int, int]]:
    out, pos = [], 0
    for gap, length, ident in items:
        pos += gap
        out.append((ident, pos, length))
        pos += length
    return out


@SETTINGS
@given(ids=st.lists(st.integers(0, 200_000), max_size=70), block=st.integers(1, 9),
       algo=st.sampled_from(ALGOS), version=st.sampled_from(["0.26.0", "0.30.0", "0.33.0"]),
       lora=st.booleans(), salt=st.sampled_from([None, "", "s", "tenant-1"]), mm=mm_st,
       embeds=st.booleans(), lookahead=st.integers(0, 3))
def test_chain_matches_the_per_block_recipe(ids: list[int], block: int, algo: str,
                                            version: str, lora: bool, salt: str | None,
                                            mm: list[tuple[int, int, str]], embeds: bool,
                                            lookahead: int) -> None:
    if version != "0.33.0":
        lookahead = 0
    items = [m for m in _layout(mm) if m[1] < max(len(ids), 1)]
    emb = (np.arange(len(ids) * 3, dtype=np.float32).reshape(len(ids), 3) if embeds
           else None)
    kw: dict[str, Any] = {}
    if lora:
        kw.update(lora_name="sql-lora", lora_path="/loras/sql")
    if salt is not None:
        kw["cache_salt"] = salt
    if items:
        kw["mm_features"] = items
    if emb is not None:
        kw["prompt_embeds"] = emb
    if lookahead:
        kw["lookahead_tokens"] = lookahead
    hasher = BlockHasher(block, algo=algo, seed="7", vllm_version=version)
    got = rows(hasher.hash(ids, **kw))
    want = reference_hashes(ids, block, algo, "7", version,
                            lora=("sql-lora", "/loras/sql") if lora else None, salt=salt,
                            mm=items, embeds=emb, lookahead=lookahead)
    assert got == want
    assert hasher.hash(ids, **kw).shape == (len(want), hasher.width)


@pytest.mark.parametrize("algo", ALGOS)
def test_long_prompts_across_chunks(algo: str) -> None:
    rng = np.random.default_rng(11)
    ids = [*rng.integers(0, 151_936, 70_000).tolist(), 2**40, 2**62, 5]
    hasher = BlockHasher(4, algo=algo, seed="0")
    assert rows(hasher.hash(ids)) == reference_hashes(ids, 4, algo, "0")


def test_list_array_and_dtypes_agree() -> None:
    ids = [5, 300, 70_000, 2**31 + 5, 0, 1, 2, 3]
    hasher = BlockHasher(2, seed="0")
    want = rows(hasher.hash(ids))
    for arr in (np.array(ids, dtype=np.int64), np.array(ids, dtype=np.uint64),
                np.array(ids, dtype=">i8"), np.array(ids, dtype=np.int64)[::1],
                tuple(ids), range(0)):
        got = rows(hasher.hash(arr))
        assert got == (want if len(arr) else [])
    small = [1, 2, 3, 4]
    assert rows(hasher.hash(np.array(small, dtype=np.int16))) == rows(hasher.hash(small))


def test_same_string_object_hashes_like_distinct_ones() -> None:
    ident = "f" * 64  # one object used twice: vLLM's two decoded strings are two objects
    mm_same = [(ident, 0, 2), (ident, 2, 2)]
    mm_distinct = [(distinct(ident), 0, 2), (distinct(ident), 2, 2)]
    hasher = BlockHasher(8, seed="0")
    got = rows(hasher.hash(list(range(8)), mm_features=mm_same))
    assert got == rows(hasher.hash(list(range(8)), mm_features=mm_distinct))
    assert got == reference_hashes(list(range(8)), 8, mm=mm_distinct)
    # and the pickle of one shared object really differs (the memo), so the copy matters
    tag = "mm"
    shared = pickle.dumps(((tag, ident, 0), (tag, ident, 2)), protocol=5)
    apart = pickle.dumps(((tag, ident, 0), (tag, distinct(ident), 2)), protocol=5)
    assert shared != apart
    assert fresh(ident) == ident and fresh(ident) is not ident


# ------------------------------------------------------------------------------ parent
@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_parent_continues_a_chain(algo: str) -> None:
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 100_000, 40).tolist()
    emb = rng.standard_normal((30, 2)).astype(np.float16)
    mm = [("img-1", 6, 10), ("img-2", 20, 3)]
    full_kw = {"mm_features": mm, "prompt_embeds": emb, "cache_salt": "t",
               "lora_name": "a", "lora_path": "/a"}
    hasher = BlockHasher(4, algo=algo, seed="1")
    whole = rows(hasher.hash(ids, **full_kw))
    first = hasher.hash(ids[:12], mm_features=[("img-1", 6, 10)], prompt_embeds=emb[:12],
                        cache_salt="t", lora_name="a", lora_path="/a")
    # the continuation: offsets and rows count from token 12; the salt has no effect there
    rest = hasher.hash(ids[12:], parent=first[-1], mm_features=[("img-1", -6, 10),
                       ("img-2", 8, 3)], prompt_embeds=emb[12:], cache_salt="ignored",
                       lora_name="a", lora_path="/a")
    assert rows(first) + rows(rest) == whole
    assert rows(hasher.hash(ids[12:], parent=bytes(first[-1]), mm_features=[
        ("img-1", -6, 10), ("img-2", 8, 3)], prompt_embeds=emb[12:], lora_name="a",
        lora_path="/a")) == whole[3:]


def test_prompt_embeds_layout_does_not_matter_only_values() -> None:
    emb = np.arange(24, dtype=np.float32).reshape(8, 3)
    hasher = BlockHasher(4, seed="0")
    ids = [0] * 8
    want = rows(hasher.hash(ids, prompt_embeds=emb))
    assert want == reference_hashes(ids, 4, embeds=emb)
    assert rows(hasher.hash(ids, prompt_embeds=emb.astype(">f4"))) == want  # byte order
    assert rows(hasher.hash(ids, prompt_embeds=np.asfortranarray(emb))) == want  # layout
    assert rows(hasher.hash(ids, prompt_embeds=emb.astype(np.float16))) != want  # dtype counts
    rows_only = rows(hasher.hash(ids, prompt_embeds=emb[:5]))  # rows past the prompt: none
    assert rows_only == reference_hashes(ids, 4, embeds=emb[:5]) and rows_only != want


def test_parent_none_hash_is_the_start() -> None:
    hasher = BlockHasher(4, seed="0")
    ids = list(range(12))
    assert rows(hasher.hash(ids, parent=hasher.none_hash)) == rows(hasher.hash(ids))


# ------------------------------------------------------------------------------ config
def test_configuration_attributes_and_repr() -> None:
    hasher = BlockHasher(16, algo="xxhash", seed="123", vllm_version="0.30.1")
    assert (hasher.algo, hasher.block_size, hasher.vllm_version, hasher.width) == (
        "xxhash", 16, "0.30.1", 16)
    assert hasher.era == "0.29-0.30"
    assert hasher.to_dict() == {"algo": "xxhash", "hash_block_size": 16,
                                "vllm_version": "0.30.1", "era": "0.29-0.30", "width": 16,
                                "seeded": True}
    assert "123" not in repr(hasher) and "<set>" in repr(hasher)
    assert BlockHasher(4).to_dict()["seeded"] is False
    assert aio_mclookup.BlockHasher is BlockHasher and "BlockHasher" in aio_mclookup.__all__


@pytest.mark.parametrize(("version", "era"), [
    ("0.26", "0.26-0.28"), ("0.26.0", "0.26-0.28"), ("0.27.1", "0.26-0.28"),
    ("0.28.0", "0.26-0.28"), ("0.29.0", "0.29-0.30"), ("0.30", "0.29-0.30"),
    ("0.31.0", "0.31-0.33"), ("0.32.0+cpu", "0.31-0.33"), ("0.33.2", "0.31-0.33"),
    ("0.33.0.post1", "0.31-0.33"),
])
def test_releases_map_to_their_era(version: str, era: str) -> None:
    assert BlockHasher(4, seed="0", vllm_version=version).era == era


def test_era_changes_the_hash_exactly_where_the_recipe_says() -> None:
    ids = list(range(8))
    kw = {"lora_name": "l", "lora_path": "/p"}
    h = {v: rows(BlockHasher(4, seed="0", vllm_version=v).hash(ids, **kw))
         for v in ("0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.33.0")}
    assert h["0.26.0"] == h["0.28.0"] == h["0.29.0"] == h["0.30.0"]  # same seed, untagged
    assert h["0.31.0"] == h["0.33.0"] != h["0.30.0"]  # tagged, with the path
    plain = {v: rows(BlockHasher(4, vllm_version=v).hash(ids)) for v in ("0.29.0", "0.33.0")}
    assert plain["0.29.0"] == plain["0.33.0"]


# ------------------------------------------------------------------------------ errors
def _raises(field: str, fn, *args, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        fn(*args, **kwargs)
    assert info.value.field == field, (info.value.field, str(info.value))
    return info.value


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "16", 2**21, None])
def test_bad_block_size(size: object) -> None:
    _raises("hash_block_size", BlockHasher, size, seed="0")


@pytest.mark.parametrize("algo", ["sha512", "SHA256", "", None, 1, "xxhash_pickle"])
def test_bad_algo(algo: object) -> None:
    err = _raises("algo", BlockHasher, 4, algo=algo, seed="0")
    assert "sha256_cbor" in str(err)


@pytest.mark.parametrize("version", ["0.25.0", "0.34.0", "1.0.0", "0.33.0rc1", "0.33.0.dev1",
                                     "v0.33.0", "latest", "", 33, None, "0.3", "0.26.0.1"])
def test_bad_release(version: object) -> None:
    err = _raises("vllm_version", BlockHasher, 4, seed="0", vllm_version=version)
    if isinstance(version, str):
        assert "0.26.0 to 0.33.x" in str(err)


@pytest.mark.parametrize(("version", "algo"), [
    ("0.26.0", "sha256"), ("0.28.0", "sha256_cbor"), ("0.27.1", "xxhash"),
    ("0.29.0", "xxhash"), ("0.33.0", "xxhash_cbor"),
])
def test_unset_seed_that_cannot_be_reproduced(version: str, algo: str) -> None:
    err = _raises("seed", BlockHasher, 4, algo=algo, vllm_version=version)
    assert "PYTHONHASHSEED" in str(err)


@pytest.mark.parametrize("seed", [42, b"42", "", "abc", "4294967296", "-1", "1.5", "0x10",
                                  "random ", "٣"])
def test_bad_seed(seed: object) -> None:
    _raises("seed", BlockHasher, 4, seed=seed)


@pytest.mark.parametrize("seed", ["0", "4294967295", "+7", " 7", "-0", "007", "random"])
def test_seeds_python_accepts(seed: str) -> None:
    assert BlockHasher(4, seed=seed).none_hash == hashlib.sha256(
        pickle.dumps(seed, protocol=5)).digest()


@pytest.mark.parametrize("ids", [
    [1, 2.0], [1, "2"], [1, None], [-1], [0, 2**63], [2**64], "1234", b"\x01\x02",
    {1, 2}, 5, np.zeros((2, 2), dtype=np.int64), np.array([1.0, 2.0]),
    np.array([True, False]), np.array([2**63], dtype=np.uint64), np.array([-3], dtype=np.int8),
])
def test_bad_token_ids(ids: object) -> None:
    _raises("token_ids", BlockHasher(1, seed="0").hash, ids)


def test_bad_token_message_names_the_index() -> None:
    err = _raises("token_ids", BlockHasher(1, seed="0").hash, [1, 2, 3.5, 4])
    assert "index 2" in str(err)
    err = _raises("token_ids", BlockHasher(1, seed="0").hash, [1, -4])
    assert "index 1" in str(err) and "negative" in str(err)


class _Huge(Sequence[int]):
    """Claims a length beyond the limit; touching an element would be a failure."""

    def __len__(self) -> int:
        return MAX_TOKENS + 1

    def __getitem__(self, i: Any) -> Any:
        raise AssertionError("the limit must be checked before the ids are read")


def test_too_many_tokens_is_refused_before_reading_them() -> None:
    err = _raises("token_ids", BlockHasher(16, seed="0").hash, _Huge())
    assert f"{MAX_TOKENS:,}" in str(err)
    big = np.broadcast_to(np.int64(1), (MAX_TOKENS + 1,))
    _raises("token_ids", BlockHasher(16, seed="0").hash, big)


@pytest.mark.parametrize("parent", [b"", b"\x00" * 31, b"\x00" * 16, "00" * 32, 5,
                                    np.zeros((1, 32), dtype=np.uint8),
                                    np.zeros(32, dtype=np.int64)])
def test_bad_parent(parent: object) -> None:
    _raises("parent", BlockHasher(4, seed="0").hash, [1, 2, 3, 4], parent=parent)


def test_parent_width_follows_the_algorithm() -> None:
    xx = BlockHasher(4, algo="xxhash", seed="0")
    out = xx.hash([1, 2, 3, 4])
    assert rows(xx.hash([5, 6, 7, 8], parent=out[0])) == rows(xx.hash([1, 2, 3, 4, 5, 6, 7, 8]))[1:]
    _raises("parent", xx.hash, [1, 2, 3, 4], parent=bytes(32))


def test_bad_extras() -> None:
    h33 = BlockHasher(4, seed="0")
    h30 = BlockHasher(4, seed="0", vllm_version="0.30.0")
    ids = list(range(8))
    _raises("lora_path", h33.hash, ids, lora_name="a")  # 0.31+ hashes the path
    assert rows(h30.hash(ids, lora_name="a")) == rows(h30.hash(ids, lora_name="a",
                                                               lora_path="/any"))
    _raises("lora_name", h33.hash, ids, lora_path="/a")
    _raises("lora_name", h33.hash, ids, lora_name="", lora_path="/a")
    _raises("lora_name", h33.hash, ids, lora_name=3, lora_path="/a")
    _raises("lora_path", h33.hash, ids, lora_name="a", lora_path="")
    _raises("cache_salt", h33.hash, ids, cache_salt=5)
    _raises("mm_features", h33.hash, ids, mm_features="abc")
    _raises("mm_features.0", h33.hash, ids, mm_features=[("a", 0)])
    _raises("mm_features.0", h33.hash, ids, mm_features=[(5, 0, 1)])
    _raises("mm_features.0", h33.hash, ids, mm_features=[("", 0, 1)])
    _raises("mm_features.0", h33.hash, ids, mm_features=[("a", 0, 0)])
    _raises("mm_features.0", h33.hash, ids, mm_features=[("a", -1, 3)])
    _raises("mm_features.0", h33.hash, ids, mm_features=[("a", 1.0, 3)])
    _raises("mm_features.1", h33.hash, ids, mm_features=[("a", 4, 2), ("b", 0, 1)])
    _raises("mm_features.1", h33.hash, ids, mm_features=[("a", 0, 3), ("b", 2, 2)])
    _raises("prompt_embeds", h33.hash, ids, prompt_embeds=[[0.0]] * 8)
    _raises("prompt_embeds", h33.hash, ids, prompt_embeds=np.zeros(8))
    _raises("prompt_embeds", h33.hash, ids, prompt_embeds=np.zeros((9, 2)))
    _raises("prompt_embeds", h33.hash, ids, prompt_embeds=np.zeros((8, 2), dtype=object))
    _raises("lookahead_tokens", h30.hash, ids, lookahead_tokens=1)
    _raises("lookahead_tokens", h33.hash, ids, lookahead_tokens=-1)
    _raises("lookahead_tokens", h33.hash, ids, lookahead_tokens=1.0)
    _raises("lookahead_tokens", h33.hash, ids, lookahead_tokens=True)


def test_missing_xxhash_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)
    err = _raises("algo", BlockHasher, 4, algo="xxhash_cbor", seed="0")
    assert "pip install 'xxhash>=3.0'" in str(err) and "aio-mclookup[" not in str(err)
    assert BlockHasher(4, algo="sha256_cbor", seed="0").width == 32  # the rest still works


def test_errors_are_value_errors_of_the_package() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(aio_mclookup.Error):
        BlockHasher(4, algo="md5")


def test_output_shape_dtype_and_copy() -> None:
    hasher = BlockHasher(4, seed="0")
    empty = hasher.hash([1, 2, 3])
    assert empty.shape == (0, 32) and empty.dtype == np.uint8
    out = hasher.hash(list(range(9)), lookahead_tokens=1)
    assert out.shape == (2, 32)
    out[0, 0] ^= 1  # writable and owned: later calls are unaffected
    assert rows(hasher.hash(list(range(9)), lookahead_tokens=1))[0] != bytes(out[0])
