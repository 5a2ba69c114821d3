"""Sequence-parallel passes on one device: one chunk call over the sequences cut into segments.

The state pass runs one program per sequence, head and value tile, walking its chunks in order: one
long sequence with few heads leaves most of the GPU idle. Cut at multiples of 64 tokens, the
segments run as more, shorter sequences in one chunk call, with the algebra of context parallelism
(affine.py): each segment gets K more value columns whose final state is its map L of the incoming
state and whose output is each token's readout C_t of it; the maps compose along every sequence in
one walk over the segments (affine.incoming; a segment that starts its sequence has L = 0 and its
initial state in R, so one walk serves all sequences), then o += C S_in and each sequence's final state is the composed R of its last
segment. Auxiliary states first take one call (two starts, one value channel) for their own maps.
A spec that does not widen takes one batched call from identity-like starts for the maps and runs
the segments again from their true incoming states. Every step is a torch operation, so the
backward (of every input, the initial state and the auxiliary ones) follows by autograd.

`count` is the schedule's choice; `plan` resolves a call's (argument, LRDSL_SEGMENTS, the choice);
`chunk` runs it. No step reads the device: packed sequences need their offsets on the host
(cu_seqlens_cpu, or cu_seqlens on the CPU), or the call keeps one pass.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from lrdsl.errors import InputError
from lrdsl.runtime.affine import aux_maps, copies, fallback_maps, finish, incoming, right_mul, wide_run, widens

ALIGN = 64  # segment boundaries fall on multiples of every kernel's chunk size
MIN_LENGTH = 1024  # a segment the schedule makes keeps at least this many tokens
NOMINAL_BV = 64  # the value tile the busy count assumes (the state pass autotunes 32..128)


def count(n_seq: int, HV: int, v_tiles: int, T: int, sms: int) -> int:
    """Segments per sequence that the schedule chooses: 1 (one pass) unless the state pass's programs
    (sequences x heads x value tiles) leave 15/16 of the SMs idle; else the power of two nearest
    below SMs / (2 x programs), none shorter than MIN_LENGTH tokens. On one H100 (132 SMs,
    2026-12-06; gated_deltanet, K = V = 128, bf16, GPU time) B=1 T=65536 H=4 (8 programs) took 1.54
    ms forward one pass, 1.21 / 1.28 / 1.42 ms in 8 / 16 / 32 segments (forward + backward 6.02 ms,
    4.46 / 4.69 / 5.21); at H=8 over two key heads (16 programs) one pass was faster (1.84 ms against
    2.23 in 8 segments): the wide run's doubled value columns cost more than the idle SMs."""
    busy = n_seq * HV * v_tiles
    if sms <= 0 or 16 * busy > sms:
        return 1
    n = min(sms // (2 * busy), T // MIN_LENGTH)
    return 1 << (n.bit_length() - 1) if n > 1 else 1


@functools.lru_cache(maxsize=16)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class Cut:
    """The segments of a call, in token order over the flattened [B*T] tokens: each one's (start,
    end), whether it continues its sequence (`through`), and each sequence's last segment."""
    bounds: tuple
    through: tuple
    lasts: tuple

    @property
    def uniform(self) -> int:
        """The segments' common length where all have one (> 0): they are then a batch [n, length]."""
        lens = {e - s for s, e in self.bounds}
        return lens.pop() if len(lens) == 1 and 0 not in lens else 0


def cut(offsets: list, length: int) -> Cut:
    """The segments of the sequences offsets[i]..offsets[i+1] (an empty one is one empty segment)."""
    bounds, through, lasts = [], [], []
    for a, b in zip(offsets, offsets[1:]):
        s = a
        while True:
            bounds.append((s, min(s + length, b)))
            through.append(s > a)
            s += length
            if s >= b:
                break
        lasts.append(len(bounds) - 1)
    return Cut(tuple(bounds), tuple(through), tuple(lasts))


def _asked(segments) -> int | None:
    """The count asked for (the argument, else LRDSL_SEGMENTS), or None to let the schedule choose."""
    where = "segments"
    if segments is None:
        segments, where = os.environ.get("LRDSL_SEGMENTS") or None, "LRDSL_SEGMENTS"
        if segments is None:
            return None
        try:
            segments = int(segments)
        except ValueError:
            segments = -1
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise InputError(f"{where} must be a positive integer (1 runs one pass; leave it unset to let "
                         f"the schedule choose), got {segments!r}")
    return segments


def plan(mixer, batch, segments, offsets) -> Cut | None:
    """The segments this chunk call runs over, or None for one pass: asked for (segments=, else
    LRDSL_SEGMENTS) or chosen by `count` on a GPU outside torch.compile where the maps ride in one
    wide run (`widens`; the fallback, e.g. rwkv6's or oja's, only asked for); never for an offline
    solve, a two-sided transition, auxiliary states updated from one another or beside a value-side
    transition (the maps do not hold), nor for packed sequences whose offsets only the device has."""
    n = _asked(segments)
    q = batch.tensors["q"]
    if n is None and (q.device.type != "cuda" or torch.compiler.is_compiling()):
        return None  # under torch.compile the call stays one custom op unless segments are asked for
    m = mixer.ir
    if n == 1 or m.solve_lam is not None or m.side == "both" or (m.side == "right" and m.aux):
        return None
    if n is None and not widens(m):  # the fallback's maps take two more runs of the segments: asked
        return None                  # for only (the wide run's one more already lost at H=8: `count`)
    names = {a.name for a in m.aux}
    if any({str(s) for e in (a.decay, a.write) for s in e.free_symbols} & names for a in m.aux):
        return None
    if batch.cu_seqlens is None:
        offsets = [b * batch.T for b in range(batch.B + 1)]
    elif offsets is None:
        if batch.cu_seqlens.device.type != "cpu":
            return None
        offsets = batch.cu_seqlens.tolist()
    offsets = [int(o) for o in offsets]
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    if n is None:
        n = count(len(offsets) - 1, batch.HV, -(-batch.V // NOMINAL_BV), longest,
                  sm_count(torch.cuda.current_device() if q.device.index is None else q.device.index))
    per = -(-longest // n)  # ceil: the longest sequence in at most n segments
    length = -(-per // ALIGN) * ALIGN
    if n <= 1 or length >= longest:
        return None
    return cut(offsets, length)


def chunk(mixer, batch, c: Cut):
    """mixer.chunk over the segments of c: (o [B, T, HV, V], the final state or None)."""
    from lrdsl.runtime.tensors import MixerState
    m = mixer.ir
    B, T, HV, K, V = batch.B, batch.T, batch.HV, batch.K, batch.V
    q = batch.tensors["q"]
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    per_token = {"q", "k", "v", *(i.name for i in m.inputs)}
    names = [a.name for a in m.aux]
    n, width, total = len(c.bounds), c.uniform, B * T

    def layout(t):  # [B, T, ...] -> the segments as a batch [n, width, ...], or packed [1, B*T, ...]
        return t.reshape(n, width, *t.shape[2:]) if width else t.reshape(1, total, *t.shape[2:])
    x = {name: layout(t) if name in per_token else t for name, t in batch.tensors.items()}
    cu = None if width else [s for s, _ in c.bounds] + [total]

    def many(x, k):  # k copies: along the batch, or packed one after the other
        if width:
            return copies(x, k, per_token)
        return {name: (torch.cat([t] * k, 1) if name in per_token else t) for name, t in x.items()}

    def run(x, S, aux):
        """chunk over (copies of) the segments from whole initial states S, aux (fp32, one row each):
        (o, final S, final aux list)."""
        h0 = MixerState(S, dict(zip(names, aux))) if names else S
        offs = None
        if cu is not None:
            offs = [o + r * total for r in range(S.shape[0] // n) for o in cu[:-1]] + [S.shape[0] // n * total]
        o, fin = mixer.chunk(**x, scale=batch.scale, initial_state=h0, output_final_state=True,
                             cu_seqlens=None if offs is None else _put(tuple(offs), dev),
                             cu_seqlens_cpu=offs, segments=1)
        return (o, fin.S, [fin.aux[a] for a in names]) if names else (o, fin, [])

    # each segment's own start: the sequence's initial state where it begins it, else zero
    through = _put(c.through, dev)
    starts = [not t for t in c.through]  # (on the host: incoming selects there, no launch)
    firsts = _put(tuple(i for i, t in enumerate(c.through) if not t), dev)
    lasts = _put(c.lasts, dev)
    A = torch.zeros(n, HV, K, V, **f32)
    if batch.initial_state is not None:
        A = A.index_copy(0, firsts, batch.initial_state.float())
    aux0 = batch.initial_aux or [None] * len(names)
    A_aux = [torch.zeros(n, HV, a.width(K, V), **f32) for a in m.aux]
    A_aux = [z if a0 is None else z.index_copy(0, firsts, a0.float()) for z, a0 in zip(A_aux, aux0)]

    def gate(X):  # X where the segment continues its sequence, zero where it starts one
        return torch.where(through.view(-1, *[1] * (X.dim() - 1)), X, torch.zeros((), dtype=X.dtype, device=dev))

    aux_in = []
    if names:  # 1. the auxiliary states entering every segment
        l, r = aux_maps(m, run, many(x, 2), A_aux, [a + gate(torch.ones_like(a)) for a in A_aux])
        aux_in = [a + incoming(li, ri, torch.mul, starts)[0] for a, li, ri in zip(A_aux, l, r)]

    if widens(m):  # 2. one wide run: o from each own start, the maps and the readouts of S_in
        E = gate(torch.eye(K, **f32).expand(n, HV, K, K))
        o_w, R, L, aux_f = wide_run(m, run, x, A, E, aux_in)
        S_in, S_out = incoming(L, R, starts=starts)
        o = finish(o_w, V, S_in) if width else _finish_packed(o_w, V, S_in, c, total)
    else:  # 2'. the maps from identity-like starts, then every segment from its true incoming state
        right = m.side == "right"  # S_out = S_in L + R
        R, L = fallback_maps(run, lambda k: many(x, k), A, aux_in, through, right=right)
        S_in, _ = incoming(L, R, right_mul if right else torch.matmul, starts=starts)
        o, S_out, aux_f = run(x, A + S_in, aux_in)
    o = o.reshape(B, T, HV, V)
    if not batch.output_final_state:
        return o, None
    S = S_out.index_select(0, lasts)
    if not names:
        return o, S
    return o, MixerState(S, {a: f.index_select(0, lasts) for a, f in zip(names, aux_f)})


def _finish_packed(o_w, V: int, S_in, c: Cut, total: int):
    """finish for packed segments: o_w [1, total, HV, V + K] laid out as a batch [n, longest] (zero
    padding), finished, and its tokens taken back in order."""
    pad, back = _packed_rows(c, total, o_w.device)
    rows = torch.cat([o_w[0], torch.zeros_like(o_w[0, :1])])
    o = finish(rows[pad], V, S_in)
    return o.reshape(-1, *o.shape[2:])[back][None]


@functools.lru_cache(maxsize=8)  # two int64 per token: a few calls' worth
def _packed_rows(c: Cut, total: int, device) -> tuple:
    """(each segment's tokens as rows [n, longest] of the packed tokens, `total` past a segment's end;
    each token's row in that batch)."""
    starts = torch.tensor([s for s, _ in c.bounds])
    lens = torch.tensor([e - s for s, e in c.bounds])
    width = int(lens.max())
    pos = torch.arange(width)
    pad = torch.where(pos < lens[:, None], starts[:, None] + pos, total)
    seg = torch.repeat_interleave(torch.arange(len(c.bounds)), lens)
    back = seg * width + torch.arange(total) - starts[seg]
    return _to(pad, device), _to(back, device)


@functools.lru_cache(maxsize=256)
def _put(values: tuple, device):
    """values as a tensor on the device, made once per (values, device): later calls copy nothing."""
    return _to(torch.tensor(values), device)


def _to(t, device):
    """A host tensor on the device without waiting for it: a copy from pageable memory would wait for
    the device's queue (a host synchronisation); from pinned memory it does not."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
