"""Fuzz the server's reply path: mutated blobs and control fields through ``ServerProtocol.on_reply``.

    python benchmarks/bench_fuzz.py --cases 100000 --seed 0 [--json out.json]

Each case takes a valid update blob (real pipelines: dgc+int8, qsgd, topk+int4, sign, identity, plus a
hand-made sparse fp32 one), applies 1-4 seeded mutations (bit flip, truncate, byte set/insert/delete, splice
of two blobs, random bytes, oversize; half of them re-sealed with a fresh CRC so the structural checks are
reached) and random control fields some of the time (seq, incarnation, example count, staleness), and judges
it with a fresh protocol. Invariants checked on every case: ``on_reply`` never raises; a case that is not
applied leaves the model bytes and the buffer identical; an applied one leaves the model finite. Prints the
count per outcome and rejection reason, the time per case, and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.faultkit import pipeline_blobs  # noqa: E402
from fedcomp.payload import TensorPayload, Update, Values  # noqa: E402
from fedcomp.protocol import Outcome, ProtocolConfig, ReplyMeta  # noqa: E402
from fedcomp.server import ServerProtocol  # noqa: E402
from fedcomp.server.optimizers import SERVER_OPTIMIZERS  # noqa: E402
from fedcomp.server.staleness import STALENESS  # noqa: E402
from fedcomp.spec import ModelSpec  # noqa: E402
from fedcomp.wire import encode  # noqa: E402

SPEC = ModelSpec((("w", (40, 25)), ("b", (25,))))
CLIENT = 9


def bases() -> list[bytes]:
    """The seed corpus of tests/test_hostile_server.py's fuzz test plus a hand-made sparse fp32 update."""
    out = pipeline_blobs(SPEC, CLIENT)
    idx = torch.tensor([1, 7, 300, 999])
    u = Update(
        {
            "w": TensorPayload((40, 25), Values.f32(torch.full((4,), 0.1)), idx),
            "b": TensorPayload((25,), Values.f32(torch.full((25,), 0.1))),
        },
        0,
        1,
        CLIENT,
    )
    return [*out, encode(u, SPEC)]


def reseal(b: bytes) -> bytes:
    body = b[:-4]
    return body + zlib.crc32(body).to_bytes(4, "little")


def _flip(b: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    if b:
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return b


def _truncate(b: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    return b[: rng.randrange(len(b) + 1)]


def _set(b: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    if b:
        b[rng.randrange(len(b))] = rng.randrange(256)
    return b


def _insert(b: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
    return b


def _delete(b: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    i = rng.randrange(len(b) + 1)
    del b[i : i + rng.randint(1, 16)]
    return b


def _splice(b: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    other = rng.choice(pool)
    return b[: rng.randrange(len(b) + 1)] + bytearray(other[rng.randrange(len(other) + 1) :])


def _random(b: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    return bytearray(rng.randbytes(rng.randrange(600)))


def _oversize(b: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    return b + bytearray(2 * SPEC.dense_bytes + 70_000)


#: mutation name -> function (bytearray, rng, pool of valid blobs) -> bytearray, with its relative frequency
MUTATIONS = {
    "flip": (_flip, 30),
    "truncate": (_truncate, 10),
    "set": (_set, 20),
    "insert": (_insert, 10),
    "delete": (_delete, 10),
    "splice": (_splice, 10),
    "random": (_random, 5),
    "oversize": (_oversize, 1),
}


def model_hash(p: ServerProtocol) -> str:
    h = hashlib.sha256()
    for n in SPEC.names:
        h.update(p.params[n].numpy().tobytes())
    h.update(f"{p.version}/{p.buffered}".encode())
    return h.hexdigest()


def make_proto() -> ServerProtocol:
    params = {n: torch.randn(s, generator=torch.Generator().manual_seed(3)) for n, s in SPEC.entries}
    cfg = ProtocolConfig(buffer_size=1, max_staleness=2, max_update_norm=50.0, weight_by_examples=True)
    return ServerProtocol(SPEC, params, SERVER_OPTIMIZERS.build("sgd", lr=1.0), STALENESS.build("constant"), cfg)


def one_case(rng: random.Random, pool: list[bytes]) -> tuple[str, str]:
    """Run one case; returns (outcome, reason category). Raises AssertionError on an invariant violation."""
    blob = bytearray(rng.choice(pool))
    names, weights = zip(*[(k, w) for k, (_, w) in MUTATIONS.items()], strict=True)
    for name in rng.choices(names, weights, k=rng.randint(1, 4)):
        blob = MUTATIONS[name][0](blob, rng, pool)
    data = bytes(blob)
    if len(data) > 4 and rng.random() < 0.5:
        data = reseal(data)
    p = make_proto()
    t = p.dispatch(CLIENT, 0.0)
    seq, inc, examples = 1, 5, 1
    if rng.random() < 0.25:
        seq = rng.choice([0, 1, 2, -1, rng.getrandbits(40)])
        inc = rng.getrandbits(62)
        examples = rng.choice([0, -3, 1, 10**18])
    if rng.random() < 0.1:  # make it stale
        for c in (30, 31, 32):
            tc = p.dispatch(c, 0.0)
            p.on_reply(c, _for(c, tc.base_version), ReplyMeta(tc.task_id, 1, 1, 1), 0.0)
    before = model_hash(p)
    d = p.on_reply(CLIENT, data, ReplyMeta(t.task_id, seq, examples, inc), 1.0)
    if d.outcome is Outcome.APPLIED:
        assert all(bool(torch.isfinite(x).all()) for x in p.params.values()), "non-finite model"
    else:
        assert model_hash(p) == before, f"model changed by a {d.outcome.value} reply: {d.reason}"
        assert d.reason, "no reason"
    return d.outcome.value, d.reason.split(":")[0] if d.outcome is Outcome.REJECTED else ""


_GOOD: dict[tuple[int, int], bytes] = {}


def _for(client: int, base: int) -> bytes:
    key = (client, base)
    if key not in _GOOD:
        u = Update(
            {n: TensorPayload(s, Values.f32(torch.full((SPEC.numel(n),), 0.01))) for n, s in SPEC.entries},
            base,
            1,
            client,
        )
        _GOOD[key] = encode(u, SPEC)
    return _GOOD[key]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the counts here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng, pool = random.Random(args.seed), bases()
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    failures: list[str] = []
    t0 = time.perf_counter()
    for i in range(args.cases):
        try:
            outcome, reason = one_case(rng, pool)
        except AssertionError as exc:
            failures.append(f"case {i}: {exc}")
            continue
        except Exception as exc:  # on_reply must never raise
            failures.append(f"case {i}: raised {type(exc).__name__}: {exc}")
            continue
        outcomes[outcome] += 1
        if reason:
            reasons[reason] += 1
    wall = time.perf_counter() - t0
    result = {
        "cases": args.cases,
        "seed": args.seed,
        "seconds": round(wall, 1),
        "us_per_case": round(1e6 * wall / max(args.cases, 1), 1),
        "violations": len(failures),
        "outcomes": dict(outcomes.most_common()),
        "reject_reasons": dict(reasons.most_common()),
    }
    print(f"{args.cases} cases in {wall:.1f} s ({result['us_per_case']} us/case), violations: {len(failures)}")
    print(f"{'outcome':<12} {'count':>8}")
    for k, v in outcomes.most_common():
        print(f"{k:<12} {v:>8}")
    print(f"{'reject reason':<22} {'count':>8}")
    for k, v in reasons.most_common():
        print(f"{k:<22} {v:>8}")
    for f in failures[:20]:
        print("VIOLATION", f)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
