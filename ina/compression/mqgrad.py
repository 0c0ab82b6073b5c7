"""MQGrad (seed 002): a SARSA agent that picks the quantization bits of a uniform quantizer.

The quantizer (``UniformQuantizer``, name "uniform"; the paper uses TensorFlow's quantize/dequantize)
maps a tensor to K-bit codes over its own [min, max] range: q = round((x - min) (2**K - 1) / (max -
min)), decoded as min + q (max - min) / (2**K - 1). Round to nearest (TensorFlow's MIN_COMBINED mode)
is biased by at most half a step; ``stochastic=True`` rounds up with probability equal to the
fraction, which is unbiased with variance at most step**2 / 4 per element.
Message of ``compress``: u1 K | f4 min | f4 max | n K-bit codes packed MSB first (K bits per value).

Switch path: the workers share a symmetric range [-R, R], R = max over workers of max|x|, negotiated
as a Q8.8 log2 exponent (see encoding.py), and send q = round(x / R * L) with L = 2**(K-1) - 1 as int8
(K in 2..8, so -127..127); the switch adds the integers and the sum decodes as sum(q) * R / L. K = 2 is
ternary. Every worker must use the same K for a tensor (MQGrad: the agent's broadcast).

The agent (``MQGradController``), as in Section 3.3 of the paper:
* every T = 5 training iterations is one MDP time step t;
* losses are smoothed, L_bar = alpha L + (1 - alpha) L_bar_prev with alpha = 0.01 (Eq. 1), and the
  state is s_t = [n_t, (L_bar_t^1, ..., L_bar_t^T)], n_t the agent's most confident bits;
* actions: 0 keeps the bits, 1 adds one (never fewer; at most ``max_bits``); the next T iterations
  use n_t + a_t bits; n_{t+1} = n_t + argmax_a Q(s_t, a) (Eq. 3; an exploratory step is a one-off);
* reward R(s_t, a_t) = -gamma * beta / c_{t+1}: beta is the least-squares slope of the next T
  smoothed losses per iteration, c_{t+1} the time those T iterations took in ms, gamma = 300;
* Q is a network 5 -> 10 (ReLU) -> 7, one output per bit width 2..8, so Q(s, a) is the output for
  n + a bits; epsilon-greedy policy (epsilon = 0.1); SARSA with eta = 0.1:
  v <- v + eta [r_{t-1} + discount Q(s_t, a_t) - Q(s_{t-1}, a_{t-1})] dQ(s_{t-1}, a_{t-1})/dv.
Choices the paper leaves open, documented here: the network sees the smoothed losses divided by the
first smoothed loss (so inputs are O(1) whatever the loss's units); the discount is 0.9 (the paper's
listing reuses the symbol gamma for it, with gamma = 300 being the reward scale); the output layer
starts at zero so that, before learning, ties keep the bits; the TD error is clipped to +-``td_clip``.

The defaults are the paper's numbers. In our synthetic test they do not learn (bits drift up about as
much whether or not more bits pay off); ``MQGradController.tuned()`` (eta 0.05, alpha 0.3, discount 0)
does: it keeps 2-3 bits while extra bits only cost time and raises them when they speed up the loss.

The controller is deterministic given its seed and the (loss, elapsed_ms) sequence, so replicas on
every worker fed the same global loss and the same elapsed times agree on K. Pass ``elapsed_ms``
explicitly for that; without it the controller measures wall-clock time between calls. The codec
``MQGrad(seed=...)`` takes the per-rank seed for stochastic rounding and a separate
``controller_seed`` (default 0, the same on every rank) for the agent.
"""
from __future__ import annotations

import math
import time

import numpy as np
from numba import njit

from ina.wire import PayloadType

from .base import Codec, Encoded, ScaleContext, from_numpy_like, to_numpy_f32
from .encoding import (Reader, be_bytes, element_count, finite_max_abs, log_scale, log_scale_exponent, pack_bits,
                       packed_size, unpack_bits)
from .kernels import uniform01


# ----------------------------------------------------------------------------- kernels
@njit(cache=True)
def _quantize(x, lo, scale, top, stochastic, seed, out):
    for i in range(x.size):
        t = (np.float64(x[i]) - lo) * scale
        if stochastic:
            f = np.floor(t)
            q = f + (1.0 if uniform01(i, seed) < t - f else 0.0)
        else:
            q = np.rint(t)
        out[i] = np.uint16(min(max(q, 0.0), top))


@njit(cache=True)
def _quantize_symmetric(x, inv_step, levels, stochastic, seed, out):
    for i in range(x.size):
        t = np.float64(x[i]) * inv_step
        if stochastic:
            f = np.floor(t)
            q = f + (1.0 if uniform01(i, seed) < t - f else 0.0)
        else:
            q = np.rint(t)
        out[i] = np.int8(min(max(q, -levels), levels))


# ----------------------------------------------------------------------------- the quantizer
class UniformQuantizer(Codec):
    name = "uniform"
    wire_id = 16
    payload_type = PayloadType.INT8
    switch_summable = True
    variable_length = False
    aggregation = "switch"
    label = "switch-feasible: K-bit codes over a shared symmetric range summed as int8"
    unbiased = False
    stochastic = False
    description = "uniform K-bit quantization over [min, max] (MQGrad's quantizer); int8 with a shared range on the switch"

    def __init__(self, bits: int = 8, stochastic: bool = False, seed: int | None = 0):
        super().__init__(seed)
        self._bits = self._check_bits(bits, 1, 16)
        self.stochastic = bool(stochastic)
        self.unbiased = bool(stochastic)

    @staticmethod
    def _check_bits(bits, lo, hi) -> int:
        if int(bits) != bits or not lo <= int(bits) <= hi:
            raise ValueError(f"quantization bits must be an integer in {lo}..{hi}, got {bits}")
        return int(bits)

    @property
    def bits(self) -> int:
        return self._bits

    @property
    def bits_per_element(self) -> float:
        return 8.0     # int8 on the switch wire; compress() packs exactly K bits per value

    # operator on one tensor
    def compress(self, x) -> Encoded:
        x32 = to_numpy_f32(x)
        finite_max_abs(x32)
        k = self.bits
        lo = np.float32(x32.min()) if x32.size else np.float32(0)
        hi = np.float32(x32.max()) if x32.size else np.float32(0)
        top = (1 << k) - 1
        rng = float(hi) - float(lo)
        q = np.empty(x32.size, np.uint16)
        _quantize(x32, float(lo), top / rng if rng > 0 else 0.0, top, self.stochastic, self.next_seed(), q)
        msg = np.concatenate([be_bytes("u1", k), be_bytes("f4", lo), be_bytes("f4", hi), pack_bits(q, k)])
        return Encoded(self.name, msg, tuple(np.shape(x)), {}, like=x)

    def decompress(self, enc: Encoded):
        n = element_count(enc.shape)
        rd = Reader(enc.codes, self.name)
        k, lo, hi = rd.bits_and_range("K", "min", "max")
        q = unpack_bits(rd.take(packed_size(n, k), "codes"), k, n)
        rd.done()
        top = (1 << k) - 1
        out = (lo + q.astype(np.float64) * ((hi - lo) / top)).astype(np.float32)
        return from_numpy_like(out, enc.like, enc.shape)

    # switch path: every rank must use the same K, so K is negotiated (max over ranks) like the scale
    def negotiated(self) -> tuple[int, ...]:
        return (self._check_bits(self.bits, 2, 8),)

    def _levels(self, ctx: ScaleContext | None = None) -> int:
        k = int(ctx.agreed[0]) if ctx is not None and ctx.agreed else self.bits
        k = self._check_bits(k, 2, 8)
        return (1 << (k - 1)) - 1

    def max_abs_code(self, ctx: ScaleContext) -> int:
        return self._levels(ctx)

    def scale_exponent(self, x32: np.ndarray) -> int:
        return log_scale_exponent(finite_max_abs(x32))

    def encode_shared(self, x32: np.ndarray, ctx: ScaleContext) -> np.ndarray:
        m = finite_max_abs(x32)
        r = log_scale(ctx.exponent)
        if m > r:
            raise ValueError(f"max |x| = {m:g} exceeds the negotiated range {r:g}: the negotiated exponent "
                             "is smaller than this tensor's")
        levels = self._levels(ctx)
        out = np.empty(x32.size, np.int8)
        _quantize_symmetric(x32, levels / r if r > 0 else 0.0, levels, self.stochastic, ctx.seed, out)
        return out

    def decode_sum(self, payload: np.ndarray, ctx: ScaleContext, raw: bool = True) -> np.ndarray:
        step = log_scale(ctx.exponent) / self._levels(ctx)
        return (np.asarray(payload).astype(np.float64) * step).astype(np.float32)


# ----------------------------------------------------------------------------- the agent
class MQGradController:
    """SARSA agent that chooses the quantization bits from smoothed losses (see the module doc).

    Feed it one global loss per training iteration with :meth:`observe_loss`; read :attr:`bits`
    for the next iteration. ``history`` records one dict per MDP step.
    """

    def __init__(self, min_bits: int = 2, max_bits: int = 8, T: int = 5, alpha: float = 0.01,
                 gamma: float = 300.0, epsilon: float = 0.1, eta: float = 0.1, discount: float = 0.9,
                 hidden: int = 10, td_clip: float = 10.0, seed: int | None = 0):
        if not 1 <= min_bits <= max_bits <= 16:
            raise ValueError(f"need 1 <= min_bits <= max_bits <= 16, got {min_bits}..{max_bits}")
        if T < 2:
            raise ValueError(f"T must be >= 2 iterations (a slope needs two points), got {T}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0 <= epsilon <= 1:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        self.min_bits, self.max_bits, self.T = int(min_bits), int(max_bits), int(T)
        self.alpha, self.gamma, self.epsilon, self.eta = float(alpha), float(gamma), float(epsilon), float(eta)
        self.discount, self.td_clip = float(discount), float(td_clip)
        self._rng = np.random.default_rng(seed)
        n_out = self.max_bits - self.min_bits + 1
        # Q network v: T inputs -> hidden ReLU -> one output per bit width
        self.W1 = self._rng.normal(0.0, 1.0 / math.sqrt(self.T), (hidden, self.T))
        self.b1 = self._rng.normal(0.0, 0.1, hidden)
        self.W2 = np.zeros((n_out, hidden))
        self.b2 = np.zeros(n_out)
        self.n = self.min_bits          # n_t: the most confident bits
        self.bits = self.min_bits       # n_t + a_t: bits for the coming iterations
        self.iteration = 0
        self.step = 0                   # MDP time step t
        self.history: list[dict] = []
        self._smoothed: float | None = None
        self._ref: float | None = None
        self._window: list[float] = []
        self._cost_ms = 0.0
        self._last_call: float | None = None
        self._prev: tuple[np.ndarray, int, int] | None = None   # (features, n, a) of s_{t-1}, a_{t-1}

    #: hyper-parameters that learn from the reward in our synthetic test (tests/test_seed_codecs.py):
    #: with the paper's alpha = 0.01 the smoothed loss averages over ~100 iterations (20 MDP steps),
    #: so the reward of one action hardly depends on it; with discount 0.9 the one-step difference
    #: between keeping and adding a bit drowns in the bootstrapped value. See docs/codecs.md.
    TUNED = {"eta": 0.05, "alpha": 0.3, "discount": 0.0}

    @classmethod
    def tuned(cls, **options) -> "MQGradController":
        """A controller with :attr:`TUNED` hyper-parameters (others as given, or the paper's)."""
        return cls(**{**cls.TUNED, **options})

    # -- Q network --------------------------------------------------------------------------------
    def q_values(self, features: np.ndarray) -> np.ndarray:
        """Q for every bit width min_bits..max_bits given the (normalised) smoothed losses."""
        h = np.maximum(self.W1 @ features + self.b1, 0.0)
        return self.W2 @ h + self.b2

    def _q(self, features, n, a) -> float:
        return float(self.q_values(features)[n + a - self.min_bits])

    def _greedy(self, features, n) -> int:
        if n >= self.max_bits:
            return 0
        q = self.q_values(features)
        return int(q[n + 1 - self.min_bits] > q[n - self.min_bits])   # ties keep the bits

    def _sgd(self, features, out_index, delta) -> None:
        pre = self.W1 @ features + self.b1
        h = np.maximum(pre, 0.0)
        dh = self.W2[out_index] * (pre > 0)
        self.W2[out_index] += self.eta * delta * h
        self.b2[out_index] += self.eta * delta
        self.W1 += self.eta * delta * np.outer(dh, features)
        self.b1 += self.eta * delta * dh

    # -- the MDP ----------------------------------------------------------------------------------
    def observe_loss(self, loss: float, elapsed_ms: float | None = None) -> int:
        """Record the global loss of one training iteration (and its duration in ms); returns the
        bits to use for the next iteration."""
        loss = float(loss)
        if not math.isfinite(loss):
            raise ValueError(f"loss {loss} is not finite")
        now = time.monotonic()
        if elapsed_ms is None:
            elapsed_ms = 0.0 if self._last_call is None else (now - self._last_call) * 1e3
        elif not (elapsed_ms >= 0 and math.isfinite(elapsed_ms)):
            raise ValueError(f"elapsed_ms must be a finite time >= 0, got {elapsed_ms}")
        self._last_call = now
        self._smoothed = loss if self._smoothed is None else self.alpha * loss + (1 - self.alpha) * self._smoothed
        if self._ref is None:
            self._ref = abs(self._smoothed) if self._smoothed != 0 else 1.0
        self._window.append(self._smoothed)
        self._cost_ms += float(elapsed_ms)
        self.iteration += 1
        if len(self._window) == self.T:
            self._mdp_step(np.array(self._window), self._cost_ms)
            self._window = []
            self._cost_ms = 0.0
        return self.bits

    def _mdp_step(self, smoothed: np.ndarray, cost_ms: float) -> None:
        feats = smoothed / self._ref
        i = np.arange(1, self.T + 1, dtype=np.float64)
        beta = float(np.polyfit(i, smoothed, 1)[0])
        reward = -self.gamma * beta / max(cost_ms, 1e-6)
        rec = {"step": self.step, "iteration": self.iteration, "beta": beta, "cost_ms": cost_ms}
        if self._prev is not None:
            pf, pn, pa = self._prev
            n = min(pn + self._greedy(pf, pn), self.max_bits)        # Eq. 3, with the pre-update Q
        else:
            n = self.n
        # epsilon-greedy action at s_t
        a = self._greedy(feats, n)
        if n < self.max_bits and self._rng.random() < self.epsilon:
            a = 1 - a
        if self._prev is not None:
            pf, pn, pa = self._prev
            delta = reward + self.discount * self._q(feats, n, a) - self._q(pf, pn, pa)
            delta = float(np.clip(delta, -self.td_clip, self.td_clip))
            self._sgd(pf, pn + pa - self.min_bits, delta)
            rec.update(reward=reward, td_error=delta)
        self._prev = (feats, n, a)
        self.n = n
        self.bits = n + a
        rec.update(n=n, action=a, bits=self.bits, q=self.q_values(feats).round(6).tolist())
        self.history.append(rec)
        self.step += 1


class MQGrad(UniformQuantizer):
    """The uniform quantizer driven by an :class:`MQGradController` (``codec.controller``)."""
    name = "mqgrad"
    wire_id = 17
    description = "MQGrad: uniform quantization with bits (2..8) chosen every T iterations by a SARSA agent"
    adaptive_width = True

    def __init__(self, controller: MQGradController | None = None, stochastic: bool = False,
                 seed: int | None = 0, controller_seed: int = 0, **controller_options):
        # the agent's seed is not the per-rank codec seed: replicas on every rank must agree on K
        if controller is None:
            controller = MQGradController(seed=controller_seed, **controller_options)
        self.controller = controller
        super().__init__(self.controller.bits, stochastic=stochastic, seed=seed)

    @property
    def bits(self) -> int:
        return self.controller.bits

    def observe_loss(self, loss: float, elapsed_ms: float | None = None) -> int:
        return self.controller.observe_loss(loss, elapsed_ms)


__all__ = ["UniformQuantizer", "MQGradController", "MQGrad"]
