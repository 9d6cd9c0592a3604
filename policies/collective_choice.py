"""Which all-reduce algorithm each gradient bucket uses, and how large buckets are, chosen from
a probe of the links the group actually has (``collective.algorithm: auto``). Pure.

At every group formation the workers time each candidate algorithm (``native``: gloo's or
NCCL's own; ``ring`` and ``hierarchical``: ours) on buffers of a few sizes, and every rank
takes the slowest rank's time (so all ranks hold the same numbers and make the same choice,
which keeps their sequences of collectives identical). Each algorithm's times are fitted
with the latency-bandwidth (alpha-beta) model ``t(s) = alpha + s / beta`` (least squares on
relative error): one noisy point among four moves the fit a little, where it would flip a
per-size comparison. From the fits:

* **per size, the fastest algorithm**: a bucket uses the algorithm predicted fastest at the
  smallest probed size that holds it (the largest probed size beyond that). Ours must beat
  ``native`` by ``NATIVE_MARGIN``: the probe runs on idle workers, but in training our
  algorithms' Python loop shares the interpreter lock with backward while the native one runs
  in C++ threads, a cost the probe cannot see;
* **the bucket size**. Where the collective runs on the cores the compute needs (gloo, CPU
  workers), every call's work is taken from backward, so overlap hides little and fewer,
  larger calls cost least: the largest probed size (measured on digits, 2 CPU workers: 4 MB
  buckets 44 ms per step, 25 MB 40 ms). Where it runs beside the compute (NCCL on GPUs),
  overlap is what hides it: the size at which latency is ``1 - BANDWIDTH_SHARE`` of a call,
  ``alpha x beta x BANDWIDTH_SHARE / (1 - BANDWIDTH_SHARE)``, so reduction starts early and
  little is left for after backward. Never below ``MIN_BUCKET_BYTES``, whose per-call costs
  outside the collective (a hook, a queued call) the probe does not see.
* **compression**: stays the user's choice; the probe also times our int8 ring at the largest
  size and says when it would have been faster (fewer bytes beat its quantizing cost only on
  slow links).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# A bucket size is good enough once it reaches this share of the best bandwidth measured.
BANDWIDTH_SHARE = 0.8
MIN_BUCKET_BYTES = 1 << 20
# Our (Python-driven) algorithms are chosen over native only when predicted this much faster:
# on digits (2 CPU workers) the ring and native probe within ~10% of each other, yet a step
# took 42.9 ms with the ring (16 MB buckets) and 39.7 ms with native (25 MB).
NATIVE_MARGIN = 0.25
# Compression is reported as worth trying when it would cut the reduction time by this share.
COMPRESSION_GAIN = 0.2


@dataclass(frozen=True)
class LinkMeasurements:
    """Seconds per all-reduce as the slowest rank measured them.

    ``sizes``: buffer bytes, ascending. ``seconds[algorithm][i]``: one all-reduce of
    ``sizes[i]`` bytes. ``int8_seconds``: our int8 ring on ``sizes[-1]`` bytes, if measured.
    """

    sizes: tuple[int, ...]
    seconds: Mapping[str, tuple[float, ...]]
    int8_seconds: float | None = None

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] <= 0:
            raise ValueError(f"probe sizes must be positive and ascending, got {self.sizes}")
        if not self.seconds:
            raise ValueError("no algorithm was measured")
        for algorithm, times in self.seconds.items():
            if len(times) != len(self.sizes) or any(not t > 0 for t in times):
                raise ValueError(f"{algorithm}: need a positive time for each of {len(self.sizes)} sizes, got {times}")


@dataclass(frozen=True)
class CollectiveChoice:
    """What ``auto`` chose: ``by_size`` as ``(bytes, algorithm)``, ascending: a bucket of ``n``
    bytes runs the algorithm of the first entry with ``bytes >= n`` (the last entry's beyond);
    ``bucket_bytes``; ``bandwidth_mb_s[algorithm][i]``: measured at ``sizes[i]``;
    ``models[algorithm]``: the fitted (latency us, bandwidth MB/s); ``compression``: advice,
    or None."""

    by_size: tuple[tuple[int, str], ...]
    bucket_bytes: int
    sizes: tuple[int, ...]
    bandwidth_mb_s: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    models: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    compression: str | None = None

    def algorithm_for(self, nbytes: int) -> str:
        for limit, algorithm in self.by_size:
            if nbytes <= limit:
                return algorithm
        return self.by_size[-1][1]

    @property
    def algorithms(self) -> tuple[str, ...]:
        """The algorithms some bucket size uses, without repeats."""
        return tuple(dict.fromkeys(a for _, a in self.by_size))

    def to_json(self) -> dict[str, Any]:
        return {
            "by_size": [{"up_to_bytes": size, "algorithm": algorithm} for size, algorithm in self.by_size],
            "bucket_mb": round(self.bucket_bytes / 2**20, 3),
            "probe_bytes": list(self.sizes),
            "bandwidth_mb_s": {a: [round(b, 1) for b in bws] for a, bws in self.bandwidth_mb_s.items()},
            "fit": {a: {"latency_us": round(lat, 1), "bandwidth_mb_s": round(bw, 1)} for a, (lat, bw) in self.models.items()},
            "compression": self.compression,
        }


@dataclass(frozen=True)
class LinkModel:
    """``seconds(s) = alpha_s + s / beta_bytes_s`` for one algorithm."""

    alpha_s: float
    beta_bytes_s: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_s

    @classmethod
    def fit(cls, sizes: tuple[int, ...], seconds: tuple[float, ...]) -> "LinkModel":
        """Least squares on relative error, alpha >= 0 and beta > 0 (a time that does not grow
        with size is all latency, at a bandwidth of one byte per picosecond)."""
        weights = [1.0 / t**2 for t in seconds]
        sw = sum(weights)
        ss = sum(w * s for w, s in zip(weights, sizes))
        sss = sum(w * s * s for w, s in zip(weights, sizes))
        st = sum(w * t for w, t in zip(weights, seconds))
        sst = sum(w * s * t for w, s, t in zip(weights, sizes, seconds))
        det = sw * sss - ss * ss
        # One size (or sizes too close to tell apart) fixes no latency: the determinant is 0
        # up to rounding, and dividing by it would give noise.
        separable = len(set(sizes)) > 1 and det > 1e-9 * sw * sss
        alpha, slope = ((sss * st - ss * sst) / det, (sw * sst - ss * st) / det) if separable else (-1.0, 0.0)
        if alpha < 0:  # through the origin
            alpha, slope = 0.0, sst / sss
        if slope <= 0:
            alpha, slope = st / sw, 1e-12
        return cls(alpha, 1.0 / slope)


def choose_collective(
    measured: LinkMeasurements, gradient_bytes: int, *, shares_cores: bool, bucket_bytes: int | None = None
) -> CollectiveChoice:
    """The choice for a gradient of ``gradient_bytes``; ``shares_cores``: the collective's work
    runs on the compute's cores (CPU workers). ``bucket_bytes`` set by the user is kept, else
    chosen (see module doc)."""
    sizes = measured.sizes
    models = {a: LinkModel.fit(sizes, times) for a, times in measured.seconds.items()}
    best = [_fastest(models, size) for size in sizes]
    by_size = tuple((size, algorithm) for size, algorithm in zip(sizes, best))
    bandwidth = {a: tuple(s / t / 1e6 for s, t in zip(sizes, times)) for a, times in measured.seconds.items()}
    if bucket_bytes is None:
        if shares_cores:
            chosen = sizes[-1]
        else:
            model = models[best[-1]]
            # At most the largest size measured: beyond it the fit is extrapolation.
            chosen = min(sizes[-1], int(model.alpha_s * model.beta_bytes_s * BANDWIDTH_SHARE / (1 - BANDWIDTH_SHARE)))
        bucket_bytes = max(MIN_BUCKET_BYTES, chosen)
    return CollectiveChoice(
        by_size=by_size,
        bucket_bytes=bucket_bytes,
        sizes=sizes,
        bandwidth_mb_s=bandwidth,
        models={a: (m.alpha_s * 1e6, m.beta_bytes_s / 1e6) for a, m in models.items()},
        compression=_compression_advice(measured, models[best[-1]], best[-1], gradient_bytes),
    )


def _fastest(models: Mapping[str, LinkModel], size: int) -> str:
    ours = min((a for a in models if a != "native"), key=lambda a: models[a].seconds(size), default=None)
    if "native" not in models:
        assert ours is not None
        return ours
    if ours is not None and models[ours].seconds(size) < (1 - NATIVE_MARGIN) * models["native"].seconds(size):
        return ours
    return "native"


def _compression_advice(measured: LinkMeasurements, model: LinkModel, fastest: str, gradient_bytes: int) -> str | None:
    if measured.int8_seconds is None:
        return None
    exact = model.seconds(measured.sizes[-1])
    if measured.int8_seconds > (1 - COMPRESSION_GAIN) * exact:
        return None
    per_step = gradient_bytes / measured.sizes[-1]
    return (
        f"int8 compression would pay on these links: {measured.sizes[-1] / 2**20:.1f} MB reduce in "
        f"{measured.int8_seconds * 1e3:.1f} ms instead of {exact * 1e3:.1f} ms ({fastest}), about "
        f"{(exact - measured.int8_seconds) * per_step * 1e3:.1f} ms less per step for this gradient; "
        "it is inexact (set collective.compression: int8 to use it)"
    )
