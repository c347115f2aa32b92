"""SGLang plans (``_plan/sglang.py``): the probed pages, their keys in page-major order, the
slices and items the coordinator asks for, and the hit; refused inputs."""

from __future__ import annotations

import random

import numpy as np
import pytest

from aio_mclookup import InvalidRequest, LookupResult, SGLangLayout
from aio_mclookup._plan.keys import ITEM_END
from aio_mclookup._plan.sglang import SGLangPlan

MHA = SGLangLayout(sglang_version="0.5.23", page_size=4, model_name="Qwen/Qwen3-8B", tp_size=2,
                   pp_size=2, prefetch_threshold=8)
WIDE_RANKS = SGLangLayout(sglang_version="0.5.20", page_size=2, model_name="m", tp_size=12,
                          prefetch_threshold=0)  # ("_9_k" and "_10_k": two key widths
MLA = SGLangLayout(sglang_version="0.5.17", page_size=4, model_name="dsv3", mla=True,
                   tp_size=8, prefetch_threshold=0)


def plan_of(layout: SGLangLayout, n: int) -> SGLangPlan:
    tokens = list(range(7, 7 + n))
    return layout.plan(n, layout.page_hashes(tokens))


def test_keys_are_page_major_then_slot() -> None:
    plan = plan_of(MHA, 17)  # 16 tokens offered: 4 pages
    hashes = MHA.page_hashes(list(range(7, 24)))
    assert plan.pages == 4 and plan.num_keys == 4 * 8 == len(plan)
    want = [
        (MHA.key_prefix + h.hex() + s).encode() for h in hashes[:4] for s in MHA.key_suffixes
    ]
    assert plan.keys == want
    assert plan.key_array() is not None and plan.key_array().tolist() == want  # type: ignore[union-attr]
    assert repr(plan) == "<LookupPlan sglang num_tokens=17 pages=4 keys=32>"


@pytest.mark.parametrize("layout", [MHA, WIDE_RANKS, MLA], ids=["mha", "wide-ranks", "mla"])
def test_slices_and_items_agree_with_the_keys(layout: SGLangLayout) -> None:
    rng = random.Random(1)
    k = layout.keys_per_page
    for n in (9, 40, 301):
        fresh = plan_of(layout, n)
        keys = plan_of(layout, n).keys
        assert len(keys) == fresh.num_keys
        for _ in range(20):
            lo = rng.randrange(0, fresh.pages) * k
            hi = rng.randrange(lo // k + 1, fresh.pages + 1) * k
            assert plan_of(layout, n)._keys_at(range(lo, hi)) == keys[lo:hi]
            assert plan_of(layout, n)._keys_at(range(lo + 1, hi)) == keys[lo + 1 : hi]
            picked = np.array(sorted(rng.sample(range(len(keys)), min(7, len(keys)))))
            assert plan_of(layout, n)._keys_at(picked) == [keys[i] for i in picked]
            if k > 1:
                items = plan_of(layout, n)._items_at(range(lo, hi))
                assert items == [
                    b"".join(key + ITEM_END for key in keys[p * k : (p + 1) * k])
                    for p in range(lo // k, hi // k)
                ]
                pages = np.array(sorted(rng.sample(range(fresh.pages), min(3, fresh.pages))))
                chunked = (pages[:, None] * k + np.arange(k)).ravel()
                assert plan_of(layout, n)._items_at(chunked) == [
                    b"".join(key + ITEM_END for key in keys[p * k : (p + 1) * k])
                    for p in pages.tolist()
                ]
        assert fresh._keys_at(range(0, fresh.num_keys)) == keys  # (after slices: the same)


def test_items_only_with_several_slots_and_no_item_end_in_keys() -> None:
    assert plan_of(MHA, 40)._chunk_keys == 8
    assert plan_of(MLA, 40)._chunk_keys == 1
    odd = SGLangLayout(sglang_version="0.5.23", page_size=4, extra_backend_tag="a\nb",
                       tp_size=2, prefetch_threshold=0)
    assert plan_of(odd, 40)._chunk_keys == 1


def test_threshold_declines_the_query() -> None:
    assert plan_of(MHA, 8).num_keys == 0  # 7 tokens offered: 1 page = 4 < 8
    assert plan_of(MHA, 9).pages == 2
    declined = MHA.plan(8, [])
    assert declined.keys == [] and declined.resolve([]) == 0
    assert declined.resolve_result([]) == LookupResult(0)


def test_resolve() -> None:
    plan = plan_of(MHA, 17)
    k = MHA.keys_per_page
    answers = [1] * plan.num_keys
    assert plan.resolve(answers) == 16
    answers[2 * k + 5] = 0  # page 2, one rank's key
    assert plan.resolve(answers) == 8
    answers[k] = -1  # page 1
    assert plan.resolve(answers) == 0  # 4 tokens < threshold 8
    assert plan.resolve_result(None) == LookupResult(0)
    assert plan.resolve_result([1] * plan.num_keys) == LookupResult(16)
    assert plan.prefix_hit(1) == 0 and plan.prefix_hit(3) == 12
    assert plan._resolve_present(np.array([True] * (k + 1) + [False] * (3 * k - 1))) == 0
    with pytest.raises(InvalidRequest):
        plan.resolve([1, 1])


def test_what_the_coordinator_reads_of_a_plan() -> None:
    plan = plan_of(MHA, 17)
    assert plan.single_full_attention and not plan.probe_in_one_round and not plan.short
    assert len(plan.geometry.namespaces) == MHA.keys_per_page
    assert plan.groups[0].limit == plan.pages and plan.groups[0].key_offset == 0
    assert plan._key_span(plan.groups[0]) == range(plan.num_keys)
    assert plan.geometry.rules is None
    other = SGLangLayout(sglang_version="0.5.23", page_size=4, model_name="Qwen/Qwen3-8B",
                         tp_size=2, pp_size=2, prefetch_threshold=8, extra_backend_tag="t")
    # (the caches tell layouts apart by these: different keys, different signatures)
    assert plan.geometry.prefix_bytes[0] != plan_of(other, 17).geometry.prefix_bytes[0]


def test_page_hashes_as_an_array_and_more_than_needed() -> None:
    tokens = list(range(40))
    hashes = MHA.page_hashes(tokens)
    blob = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, 32)
    assert MHA.plan(40, blob).keys == MHA.plan(40, hashes).keys
    # prompt logprobs from position 20: the length to pass is 21
    assert MHA.plan(21, hashes).keys == MHA.plan(21, hashes[:5]).keys


@pytest.mark.parametrize(
    ("n", "hashes", "match"),
    [
        (40, [b"x" * 32] * 3, "probes 9 pages"),
        (40, [b"x" * 31] * 10, "32-byte"),
        (40, ["ab" * 32] * 10, "must be bytes"),
        (40, b"x" * 320, "sequence of bytes"),
        (-1, [], "num_tokens must be >= 0"),
        (40.0, [], "num_tokens must be an int"),
    ],
)
def test_refused(n: object, hashes: object, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        MHA.plan(n, hashes)  # type: ignore[arg-type]


def test_probe_state_out_of_order_keeps_the_threshold() -> None:
    from aio_mclookup._plan.probing import ProbeState

    layout = SGLangLayout(sglang_version="0.5.23", page_size=4, prefetch_threshold=12)
    tokens = list(range(100, 141))
    plan = layout.plan(len(tokens), layout.page_hashes(tokens))
    state = ProbeState(plan)
    state.next_keys(None)
    state.record(np.array([6, 7]), [True, True])  # page 3 first
    state.record(range(0, 6), [True, True, True, True, False, False])  # page 2 missing
    assert not len(state.next_keys(None))
    assert state.hit == plan.resolve([1, 1, 1, 1, 0, 0] + [1] * (plan.num_keys - 6)) == 0


# ------------------------------------------------------------------ plans from token ids
TOKEN_LAYOUTS = [
    MHA,
    WIDE_RANKS,
    MLA,
    SGLangLayout(sglang_version="0.5.23", page_size=16, model_name="m", tp_size=2, eagle=True,
                 prefetch_threshold=64),
    SGLangLayout(sglang_version="0.5.20", page_size=1, model_name="m", prefetch_threshold=0),
]


def _tokens_of(rng: random.Random, kind: str) -> object:
    n = rng.choice([0, 1, 5, 17, 63, 64, 65, 200, 600, 1500])
    ids = [rng.randrange(0, 150_000) for _ in range(n)]
    if kind == "wide" and n:  # (a wide page on 0.5.23, refused before)
        ids[rng.randrange(n)] = 2**40
    if kind == "negative" and n:
        ids[rng.randrange(n)] = -3
    if kind == "array":
        return np.array(ids, dtype=rng.choice([np.int64, np.uint32, np.int32, np.uint64]))
    if kind in ("array-wide", "array-negative") and n:  # (one id that does not fit 32 bits)
        ids[rng.randrange(n)] = 2**40 if kind == "array-wide" else -3
        return np.array(ids, dtype=np.int64)
    if kind == "array-int32-negative" and n:
        ids[rng.randrange(n)] = -3
        return np.array(ids, dtype=np.int32)
    return tuple(ids) if kind == "tuple" else ids


_ARRAY_KINDS = ["array", "array-wide", "array-negative", "array-int32-negative"]


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in-place"])
@pytest.mark.parametrize("kind", ["list", "tuple", "wide", "negative", *_ARRAY_KINDS])
@pytest.mark.parametrize(
    "layout", TOKEN_LAYOUTS, ids=lambda x: f"{x.sglang_version}-p{x.page_size}"
)
def test_a_plan_from_token_ids_is_the_plan_of_its_page_hashes(
    layout: SGLangLayout, kind: str, in_place: bool
) -> None:
    rng = random.Random(f"{layout.page_size}{kind}")
    for _ in range(12):
        tokens = _tokens_of(rng, kind)
        extra = rng.choice([None, "lora-a"])
        salt = rng.choice([None, "", "s"])
        try:
            want = layout.plan(len(tokens), layout.page_hashes(tokens, extra, salt))  # type: ignore[arg-type]
        except InvalidRequest as exc:
            with pytest.raises(InvalidRequest, match="token id") as got:
                layout.plan_tokens(tokens, extra, salt, in_place=in_place).prepare()
            assert str(got.value) == str(exc)
            continue
        plan = layout.plan_tokens(tokens, extra, salt, in_place=in_place)
        assert plan.num_keys == want.num_keys and plan.pages == want.pages
        if plan.needs_preparing:  # (many pages: hashed when prepared)
            assert plan.pages >= 16
            plan.prepare()
            assert not plan.needs_preparing
            plan.prepare()  # (once prepared, again is nothing)
        assert plan.keys == want.keys
        answers = [rng.choice([1, 1, 1, 0]) for _ in want.keys]
        assert plan.resolve(answers) == want.resolve(answers)


@pytest.mark.parametrize(
    "layout", TOKEN_LAYOUTS, ids=lambda x: f"{x.sglang_version}-p{x.page_size}"
)
def test_a_plan_not_prepared_yet_prepares_when_its_keys_or_answer_are_read(
    layout: SGLangLayout,
) -> None:
    rng = random.Random(layout.page_size)
    tokens = [rng.randrange(0, 150_000) for _ in range(40 * layout.page_size + 3)]
    want = layout.plan(len(tokens), layout.page_hashes(tokens, "x"))
    answers = [rng.choice([1, 1, 1, 0]) for _ in want.keys]
    reads = {
        "keys": lambda plan: plan.keys,
        "key_array": lambda plan: (lambda a: None if a is None else a.tolist())(
            plan.key_array()
        ),
        "groups": lambda plan: [g.chunks.tolist() for g in plan.groups],
        "resolve": lambda plan: plan.resolve(answers),
        "resolve_result": lambda plan: plan.resolve_result(answers).hit_length,
    }
    for name, read in reads.items():
        plan = layout.plan_tokens(tokens, "x")
        assert plan.needs_preparing, name
        assert read(plan) == read(want), name
        assert plan.keys == want.keys, name  # (prepared by now, whatever the first read)
        assert not plan.needs_preparing, name
        assert type(plan) is type(want), name  # (a plain plan once prepared)


def test_a_plan_from_token_ids_hashes_on_a_native_worker_as_here() -> None:
    import select

    from aio_mclookup._coordinator import shell
    from aio_mclookup._hashing import sglang

    if shell._WORKER is None or sglang._C is None:
        pytest.skip("the C extensions are not built, or not loaded")
    NativeWorker = shell._WORKER.NativeWorker

    rng = random.Random(4)
    worker = NativeWorker()
    try:
        for layout in TOKEN_LAYOUTS:
            tokens = [rng.randrange(0, 150_000) for _ in range(1500)]
            plan = layout.plan_tokens(tokens, "x", None)
            job = plan.native_job()
            assert job is not None
            worker.submit(job, 1)
            assert select.select([worker.fileno()], [], [], 10)[0]
            assert worker.collect() == [1]
            plan.prepare(job)
            assert plan.keys == layout.plan(1500, layout.page_hashes(tokens, "x")).keys
    finally:
        worker.close()


@pytest.mark.parametrize("kind", _ARRAY_KINDS)
def test_a_plan_of_an_array_in_place_hashes_it_on_a_native_worker_as_here(kind: str) -> None:
    """The worker's job reads the array itself (every 4- and 8-byte integer dtype); an id
    that does not fit 32 bits leaves the job without digests, and the plan hashes the pages
    here instead: wide pages on 0.5.23, the same error as ``page_hashes`` before."""
    import select

    from aio_mclookup._coordinator import shell
    from aio_mclookup._hashing import sglang

    if shell._WORKER is None or sglang._C is None:
        pytest.skip("the C extensions are not built, or not loaded")
    rng = random.Random(kind)
    worker = shell._WORKER.NativeWorker()
    try:
        for layout in [*TOKEN_LAYOUTS, SGLangLayout(sglang_version="0.5.17", page_size=16)]:
            for _ in range(6):
                n = rng.choice([40, 90]) * layout.page_size + 3  # (16 pages or more)
                ids = [rng.randrange(0, 150_000) for _ in range(n)]
                dtype = rng.choice([np.int64, np.uint32, np.int32, np.uint64])
                if kind != "array":  # (one id that does not fit 32 bits)
                    ids[rng.randrange(len(ids))] = 2**40 if kind == "array-wide" else -3
                    dtype = np.int32 if kind == "array-int32-negative" else np.int64
                tokens = np.array(ids, dtype=dtype)
                if layout.eagle:  # (bigram pages: packed here, as without in_place)
                    continue
                plan = layout.plan_tokens(tokens, "x", None, in_place=True)
                job = plan.native_job()
                assert isinstance(plan._chain, sglang.PendingArrayPages)  # type: ignore[attr-defined]
                assert job is not None
                worker.submit(job, 1)
                assert select.select([worker.fileno()], [], [], 10)[0]
                assert worker.collect() == [1]
                try:
                    want = layout.plan(len(tokens), layout.page_hashes(tokens, "x")).keys
                except InvalidRequest as exc:
                    with pytest.raises(InvalidRequest, match="token id") as got:
                        plan.prepare(job)
                    assert str(got.value) == str(exc)
                    continue
                plan.prepare(job)
                assert plan.keys == want
    finally:
        worker.close()


def test_ids_pages_jobs_read_what_they_can_in_place_and_refuse_the_rest() -> None:
    from aio_mclookup._hashing import sglang

    C = sglang._C
    if C is None:
        pytest.skip("the C extensions are not built, or not loaded")
    ids = np.arange(64 * 3 + 5, dtype=np.int64)
    for bad in (ids.astype(np.float64), ids.reshape(-1, 1), ids[::2], ids.astype(np.int16),
                ids.tobytes(), bytearray(ids.tobytes()), [1, 2, 3], ids.astype(">i8")):
        assert C.ids_pages_job(b"", bad, 64, 1) is None, bad
    assert C.ids_pages_job(b"", ids, 64, 4) is None  # (three whole pages only)
    with pytest.raises(ValueError, match="page_size"):
        C.ids_pages_job(b"", ids, 0, 1)
    with pytest.raises(ValueError, match="seed"):
        C.ids_pages_job(b"abc", ids, 64, 1)
    job = C.ids_pages_job(b"", ids, 64, 3)
    with pytest.raises(RuntimeError, match="not run"):
        C.ids_page_digests(job)
    with pytest.raises(TypeError, match="not an ids pages job"):
        C.ids_page_digests(C.pages_job(b"", b"\0" * 8, 4))
    with pytest.raises(TypeError, match="not a pages job"):
        C.page_digests(job)


def test_a_declined_or_short_prompt_plans_at_once() -> None:
    assert not MHA.plan_tokens(list(range(8))).needs_preparing  # (below the threshold)
    assert MHA.plan_tokens(list(range(8))).num_keys == 0
    assert not MHA.plan_tokens(list(range(40))).needs_preparing  # (9 pages: hashed here)
    assert MHA.plan_tokens(list(range(400))).needs_preparing
    with pytest.raises(InvalidRequest, match="extra_key"):
        MHA.plan_tokens(list(range(400)), extra_key=3)  # type: ignore[arg-type]
