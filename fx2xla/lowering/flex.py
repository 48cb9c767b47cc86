"""Lowering rules: FlexAttention (`torch.nn.attention.flex_attention`), forward and backward.

Dynamo turns `flex_attention(q, k, v, score_mod=, block_mask=)` into the higher-order op
`flex_attention`, whose score_mod and mask_mod arrive as GraphModules over 0-d values (a score
and the b, h, q_idx, kv_idx indices); AOTAutograd adds `flex_attention_backward`. Eager runs
them as dense ("math") attention, vmapping score_mod and mask_mod over the whole score matrix;
Inductor generates a blocked kernel that reads the BlockMask's tables. Here each subgraph runs
through the ordinary lowering rules under four nested `jax.vmap`s, as eager vmaps it, so any op
that has a rule may appear in a score_mod (a bias table indexed by head, a soft cap, ...), and
the index checks of its gathers are kept (their codes are reduced over the grid).

Which scores count is the BlockMask's meaning, as the compiled kernels read it: a key block
listed among a query block's "full" blocks counts wholly, one listed among its partial blocks
counts where mask_mod says so, and an unlisted one not at all. For a mask built by
`create_block_mask(mask_mod)` that is exactly mask_mod (eager's dense path applies mask_mod
alone); a BlockMask built from tables (`BlockMask.from_kv_blocks`) is honored as the kernels
honor it, where eager's dense path would ignore its tables.

Numerics follow eager's dense path: scores and softmax in float32 (float64 for float64
inputs), the probabilities rounded to the inputs' dtype before the product with V (the block
walk below rounds unnormalized ones, as the kernels do); a row whose
every score is masked gives output 0 and logsumexp -inf. The op returns the logsumexp and the
row maxima in base 2 (divided by ln 2), as the kernels do; `flex_attention` converts back.

The backward is eager's formula with the saved output and logsumexp; the gradient through
score_mod (and to the tensors it captures, e.g. a learnable bias) is jax's vjp of the vmapped
forward subgraph, which is what AOTAutograd's joint graph computes.

Where the BlockMask has at least two key blocks, forward and backward walk the blocks its
tables list and skip the rest, as the kernels do: a loop over query blocks and, within it, over
their listed key blocks (`_Walk`); the forward keeps an online softmax (running maximum, sum and
output in the working precision; bf16 outputs then differ from eager's dense path by an ulp in
places, as the kernels' do), the backward adds each step's key and value gradients at the keys
it visited. Otherwise the score matrix is materialized, dense, and past `CHUNK_SCORES` scores
taken in chunks of query rows."""
from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx
from jax import lax

from .checks import CODE_DTYPE, no_failure
from .control_flow import run_subgraph
from .dtypes import to_torch_dtype
from .linalg import dot, matmul_precision
from .registry import PYTHON_OPS, concrete_shape, lowering_for_node, register_lowering

higher_order = torch.ops.higher_order

LN2 = math.log(2.0)
# BlockMask tuple (BlockMask.as_tuple(), torch 2.13): q_len, kv_len, kv_num_blocks, kv_indices,
# full_kv_num_blocks, full_kv_indices, four q-major tables, four backward orderings,
# Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod.
KV_NUM, KV_IDX, FULL_NUM, FULL_IDX = 2, 3, 4, 5


def _graph(gm, arg):
    """The GraphModule an argument names (a get_attr node), or None."""
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        sub = getattr(gm, arg.target)
        return sub if isinstance(sub, torch.fx.GraphModule) else None
    return None


def _forward_subgraphs(gm, node):
    return [g for g in (_graph(gm, node.args[3]), _graph(gm, node.args[4][-1])) if g is not None]


def _backward_subgraphs(gm, node):
    # The joint graph is not lowered: the gradient through score_mod is jax's vjp of fw_graph.
    return [g for g in (_graph(gm, node.args[7]), _graph(gm, node.args[9][-1])) if g is not None]


def _lowerable_graph(sub: torch.fx.GraphModule) -> bool:
    for n in sub.graph.nodes:
        if n.op != "call_function" or n.target in PYTHON_OPS:
            continue
        rule = lowering_for_node(n)
        if rule is None or rule.draws(n) or rule.subgraphs is not None:
            return False
    return True


def _accepts(subgraphs):
    """Lower the node when every op of its score_mod and mask_mod has a rule and draws no
    random bits (a vmapped draw would repeat one value over the grid); else it falls back."""
    def accepts(node):
        gm = node.graph.owning_module
        return gm is not None and all(_lowerable_graph(s) for s in subgraphs(gm, node))
    return accepts


class _MetaRecorder(torch.fx.Interpreter):
    """Runs a graph on meta tensors, keeping each node's result as its meta value."""

    def run_node(self, n):
        result = super().run_node(n)
        n.meta["val"] = result
        return result


def _in_working_precision(ctx, gm, dtype):
    """`gm` (a score_mod over a 0-d score) with its score in `dtype`, the working precision:
    Dynamo traces it on a score of the inputs' dtype (bf16 for bf16 inputs), but eager's dense
    path, like the kernels, runs it on float32 scores. Every node's dtype is propagated again
    from there on meta tensors, so a captured bf16 tensor added to the score promotes to float32
    as in eager. A copy: the GraphModule is Dynamo's."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if placeholders[0].meta["val"].dtype == dtype:
        return gm
    gm = copy.deepcopy(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = []
    for i, n in enumerate(placeholders):
        val = n.meta["val"]
        if isinstance(val, torch.Tensor):
            inputs.append(torch.empty(concrete_shape(val.shape, ctx.sizes), device="meta",
                                      dtype=dtype if i == 0 else val.dtype))
        else:
            inputs.append(val)
    _MetaRecorder(gm).run(*inputs)
    return gm


def _at_one_point(ctx, gm):
    """`gm` on 0-d values: (its result, the code of the first index check that failed)."""
    checks = ctx.checks

    def one(*args):
        inner = checks.nested() if checks is not None else None
        out = run_subgraph(ctx, gm, list(args), None, checks=inner)[0]
        code = inner.code() if inner is not None else None
        return out, (no_failure() if code is None else code)
    return one


def _grid(ctx, gm, B: int, H: int, N: int, with_score: bool, nbuf: int):
    """`gm` (score_mod or mask_mod over 0-d values) as a function over a [B, H, R, N] block of
    the grid: f(score, rows, *buffers) -> (values, check code), or f(rows, *buffers) for a
    mask_mod, where `rows` are the R query indices of the block. The buffers (the tensors the
    function captured) are arguments so that jax.vjp can differentiate with respect to them."""
    b, h, n = (jnp.arange(s, dtype=jnp.int32) for s in (B, H, N))
    lead = (0,) if with_score else ()
    fn = _at_one_point(ctx, gm)
    # innermost: kv_idx, then q_idx, h, b; the score varies along every axis
    for pos in (3, 2, 1, 0):
        axes = [None] * 4
        axes[pos] = 0
        fn = jax.vmap(fn, in_axes=(*lead, *axes, *([None] * nbuf)))

    def run(*args):
        score = args[:1] if with_score else ()
        rows, buffers = args[len(score)], args[len(score) + 1:]
        out, code = fn(*score, b, h, jnp.asarray(rows, jnp.int32), n, *buffers)
        out = jnp.broadcast_to(out, (B, H, len(rows), N))
        return out, _first_code(code)
    return run


def _block_grid(ctx, gm, B: int, H: int, with_score: bool, nbuf: int):
    """`gm` over the blocks one step of the block walk visits: f(score, rows, cols, *buffers) ->
    (values [B, H, Gq, R, C], check code), or f(rows, cols, *buffers) for a mask_mod, where
    `rows` [Gq, R] are the query indices of Gq query blocks and `cols` [B, H, Gq, C] the key
    indices of the key block each (batch, head) visits for each of them."""
    b, h = (jnp.arange(s, dtype=jnp.int32) for s in (B, H))
    lead = (0,) if with_score else ()
    bufs = (None,) * nbuf
    fn = _at_one_point(ctx, gm)
    # (b, h, q_idx, kv_idx) axes, innermost first: keys, rows, query blocks, heads, batch
    for axes in ((None, None, None, 0), (None, None, 0, None), (None, None, 0, 0), (None, 0, None, 0),
                 (0, None, None, 0)):
        fn = jax.vmap(fn, in_axes=(*lead, *axes, *bufs))

    def run(*args):
        score = args[:1] if with_score else ()
        rows, cols, buffers = args[len(score)], args[len(score) + 1], args[len(score) + 2:]
        cols = jnp.broadcast_to(cols, (B, H) + cols.shape[2:])
        out, code = fn(*score, b, h, rows, cols, *buffers)
        return jnp.broadcast_to(out, (B, H) + rows.shape + cols.shape[-1:]), _first_code(code)
    return run


def _first_code(code):
    """The failing check with the lowest number over the grid (each element's code is already
    the first failure of its own evaluation), or 0."""
    code = jnp.asarray(code, CODE_DTYPE)
    if code.ndim == 0:
        return code
    big = jnp.iinfo(np.int32).max
    first = jnp.min(jnp.where(code == 0, big, code))
    return jnp.where(first == big, no_failure(), first)


class _Blocks:
    """A block table (num[..., qb]: how many entries of idx[..., qb, :] are listed) as a dense
    bool [..., q blocks, kv blocks], expanded to elements for the rows asked for."""

    def __init__(self, num, idx, cols: int, block_rows: int, block_cols: int):
        nqb, width = idx.shape[-2], idx.shape[-1]
        nkb = max(-(-cols // block_cols), width)  # enough columns for every listed block
        listed = jnp.arange(width, dtype=num.dtype) < num[..., None]
        col = jnp.where(listed, idx, nkb)  # unlisted entries land in a column that is dropped
        lead = idx.shape[:-2]
        index = tuple(jnp.arange(s).reshape((-1,) + (1,) * (len(lead) + 1 - d))
                      for d, s in enumerate(lead + (nqb,)))
        dense = jnp.zeros(lead + (nqb, nkb + 1), jnp.bool_).at[index + (col,)].set(True, mode="drop")[..., :nkb]
        # kv block -> keys: keys of block kb are [kb * block_cols, (kb + 1) * block_cols)
        if block_cols <= cols <= nkb * block_cols:
            dense = jnp.repeat(dense, block_cols, axis=-1, total_repeat_length=nkb * block_cols)[..., :cols]
        else:  # one block wider than the sequence (the no-op mask's)
            dense = jnp.take(dense, jnp.asarray(np.minimum(np.arange(cols) // block_cols, nkb - 1)), axis=-1)
        self.dense, self.nqb, self.block_rows = dense, nqb, block_rows

    def rows(self, rows):
        """[..., len(rows), cols]: the listed keys of each query row in `rows`."""
        nqb, block_rows = self.nqb, self.block_rows
        if isinstance(rows, np.ndarray) and block_rows <= len(rows) <= nqb * block_rows \
                and np.array_equal(rows, np.arange(len(rows))):
            return jnp.repeat(self.dense, block_rows, axis=-2, total_repeat_length=nqb * block_rows)[..., :len(rows), :]
        block = jnp.minimum(jnp.asarray(rows) // block_rows, nqb - 1)
        return jnp.take(self.dense, block, axis=-2)


def _working(dtype):
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _wide_dot(a, b, contract, batch, dtype):
    """dot_general accumulating into `dtype` (float32 for half inputs, on GPUs too): products
    summed over query-row chunks are added up in it."""
    return lax.dot_general(a, b, (contract, batch), precision=matmul_precision(a.dtype),
                           preferred_element_type=dtype)


# Scores (batch x heads x query rows x keys) computed at once. Past this, a loop takes the query
# rows in chunks: memory then grows with the sequence length, not with its square, where the
# dense path (eager's) would hold several [B, H, M, N] float32 arrays at once.
CHUNK_SCORES = 1 << 24


def row_chunk(B: int, H: int, M: int, N: int, block_rows: int) -> int | None:
    """Query rows per chunk, or None: all rows at once."""
    rows = CHUNK_SCORES // max(1, B * H * N)
    if rows >= M:
        return None
    rows = max(1, rows)
    if block_rows <= rows:
        rows -= rows % block_rows  # whole query blocks
    return rows


class _Attention:
    """One flex_attention node's operands and subgraphs, and its math over a block of query rows.

    Key and value may have one batch row (broadcast over the query's) and fewer heads
    (grouped-query attention: kv head j serves query heads [j*G, (j+1)*G)): each kv head's group
    of query rows is one block of rows of a dot, so K and V are never copied per query head."""

    def __init__(self, ctx, query, key, value, score_mod, block_mask, scale, score_bufs, mask_bufs):
        self.B, self.H, self.M, _ = query.shape
        self.Bkv, self.Hkv, self.N = key.shape[0], key.shape[1], key.shape[2]
        if self.H % self.Hkv:
            raise ValueError(f"query heads {self.H} are not a multiple of key/value heads {self.Hkv}")
        if self.Bkv not in (1, self.B):
            raise ValueError(f"query batch {self.B} and key/value batch {self.Bkv} do not broadcast")
        self.G = self.H // self.Hkv
        self.dtype, self.wp = query.dtype, _working(query.dtype)
        self.scale = jnp.asarray(scale, self.wp)
        self.score_bufs = [b if hasattr(b, "dtype") else jnp.asarray(b) for b in score_bufs]
        self.mask_bufs = [b if hasattr(b, "dtype") else jnp.asarray(b) for b in mask_bufs]
        block_rows, block_cols, mask_mod = block_mask[-3], block_mask[-2], block_mask[-1]
        self.chunk = row_chunk(self.B, self.H, self.M, self.N, block_rows)
        # The dense path's reading of the tables. Built here also for the block walk, which
        # leaves them unread (XLA drops them): block sizes that are traced values (a
        # dynamic-shape lowering, retried with concrete ones) fail here, before any walk.
        self.partial = _Blocks(block_mask[KV_NUM], block_mask[KV_IDX], self.N, block_rows, block_cols)
        self.full = (None if block_mask[FULL_NUM] is None else
                     _Blocks(block_mask[FULL_NUM], block_mask[FULL_IDX], self.N, block_rows, block_cols))
        self.mask = _grid(ctx, mask_mod, self.B, self.H, self.N, False, len(self.mask_bufs))
        score_mod = _in_working_precision(ctx, score_mod, to_torch_dtype(self.wp))
        self.mask_gm, self.score_gm = mask_mod, score_mod
        self.score = _grid(ctx, score_mod, self.B, self.H, self.N, True, len(self.score_bufs))
        self.key = jnp.broadcast_to(key, (self.B,) + key.shape[1:])
        self.value = jnp.broadcast_to(value, (self.B,) + value.shape[1:])

    def kept(self, rows):
        """Which scores of these rows count, [B or 1, H or 1, R, N] bool, and mask_mod's code."""
        mask, code = self.mask(rows, *self.mask_bufs)
        keep = mask & self.partial.rows(rows)
        if self.full is not None:
            keep = keep | self.full.rows(rows)
        return keep, code

    def with_buffers(self, diff, diff_bufs) -> list:
        """score_mod's captured tensors with those at positions `diff` replaced by `diff_bufs`
        (the ones jax.vjp differentiates)."""
        bufs = list(self.score_bufs)
        for i, b in zip(diff, diff_bufs):
            bufs[i] = b
        return bufs

    def scores(self, q):
        """scale * q k^T in the working precision, [B, H, R, N], for query rows q [B, H, R, E]."""
        R = q.shape[2]
        qg = q.astype(self.wp).reshape(self.B, self.Hkv, self.G * R, q.shape[-1])
        s = dot(qg, self.key.astype(self.wp), ((3,), (3,)), ((0, 1), (0, 1)))
        return s.reshape(self.B, self.H, R, self.N) * self.scale

    def times_values(self, g, v):
        """g [B, H, R, D] @ v^T [B, Hkv, D, N] -> [B, H, R, N]."""
        R = g.shape[2]
        out = dot(g.reshape(self.B, self.Hkv, self.G * R, g.shape[-1]), v, ((3,), (3,)), ((0, 1), (0, 1)))
        return out.reshape(self.B, self.H, R, self.N)

    def rows_times(self, p, kv):
        """p [B, H, R, N] @ kv [B, Hkv, N, D] -> [B, H, R, D], in p's dtype's dot result."""
        R = p.shape[2]
        out = dot(p.reshape(self.B, self.Hkv, self.G * R, self.N), kv, ((3,), (2,)), ((0, 1), (0, 1)))
        return out.reshape(self.B, self.H, R, kv.shape[-1])

    def cols_times(self, p, x):
        """p^T [B, H, N, R] @ x [B, H, R, D], summed over each kv head's group: [B, Hkv, N, D],
        accumulated in the working precision."""
        R = p.shape[2]
        pg = p.reshape(self.B, self.Hkv, self.G, R, self.N)
        xg = x.reshape(self.B, self.Hkv, self.G, R, x.shape[-1])
        return _wide_dot(pg, xg, ((2, 3), (2, 3)), ((0, 1), (0, 1)), self.wp)

    def kv_grad(self, g):
        """A [B, Hkv, N, D] gradient summed over the batch where key/value had one row."""
        if self.Bkv == 1 and self.B != 1:
            g = jnp.sum(g, axis=0, keepdims=True)
        return g

    def over_rows(self, step, padded, carry=None):
        """`step(rows, *row_slices, carry) -> (carry, outputs)` over every query row: at once, or
        in chunks by a loop when the scores would be too many (`padded`: [B, H, M, ...] arrays
        sliced per chunk, padded with their given fill value to whole chunks). Returns
        (carry, outputs [B, H, M, ...])."""
        if self.chunk is None:
            return step(np.arange(self.M), *[a for a, _ in padded], carry)
        R, M = self.chunk, self.M
        count = -(-M // R)
        padded = [jnp.pad(a, [(0, 0), (0, 0), (0, count * R - M)] + [(0, 0)] * (a.ndim - 3),
                          constant_values=fill) for a, fill in padded]

        def body(carry, c):
            start = c * R
            # rows past the end repeat the last row (indices a score_mod may read stay in range)
            rows = jnp.minimum(start + jnp.arange(R, dtype=jnp.int32), M - 1)
            slices = [lax.dynamic_slice_in_dim(a, start, R, axis=2) for a in padded]
            return step(rows, *slices, carry)

        carry, outs = lax.scan(body, carry, jnp.arange(count, dtype=jnp.int32))
        # [count, B, H, R, ...] -> [B, H, count * R, ...] -> the first M rows
        outs = [jnp.moveaxis(o, 0, 2).reshape(o.shape[1:3] + (count * R,) + o.shape[4:])[:, :, :M]
                if o.ndim >= 4 else o for o in outs]
        return carry, outs


# The forward walks the listed key blocks of each query block (as the kernels do, skipping the
# rest) once there are at least this many key blocks; below, one dense pass costs less.
WALK_MIN_KV_BLOCKS = 2


def walk_plan(platform: str, B: int, H: int, M: int, N: int, block_mask) -> int | None:
    """How many query blocks one step of the block walk takes (None: the dense path). On the
    CPU one (each query block visits exactly its own listed key blocks, so a causal mask does
    half the work); elsewhere as many as keep a step's scores (batch x heads x their rows x one
    key block) within `CHUNK_SCORES`, all of them for most shapes: each visits its t-th listed
    block at step t (fewer, larger steps for a GPU: as many as the most blocks any lists)."""
    block_rows, block_cols = block_mask[-3], block_mask[-2]
    nqb = block_mask[KV_IDX].shape[-2]
    if not (isinstance(block_rows, int) and isinstance(block_cols, int)) or nqb != -(-M // block_rows):
        return None  # tables that do not tile the query rows: the dense path's reading of them
    if -(-N // block_cols) < WALK_MIN_KV_BLOCKS:
        return None
    if platform == "cpu":
        return 1
    return max(1, min(nqb, CHUNK_SCORES // max(1, B * H * block_rows * block_cols)))


class _Walk:
    """The listed blocks of a BlockMask, walked: a loop over groups of `group` query blocks and,
    within it, over the key blocks they list (partial ones first, then full ones). At step t each
    query block visits its t-th listed block; a (batch, head) whose tables list fewer blocks than
    another's sits out the extra steps (nothing it computes there counts)."""

    def __init__(self, ctx, att, block_mask, group: int):
        self.att, self.group = att, group
        B, H, Hkv, N = att.B, att.H, att.Hkv, att.N
        self.BR, self.BC = BR, BC = block_mask[-3], block_mask[-2]
        num_p, idx_p = block_mask[KV_NUM], block_mask[KV_IDX]
        num_f, idx_f = block_mask[FULL_NUM], block_mask[FULL_IDX]
        if num_f is None:
            num_f, idx_f = jnp.zeros_like(num_p), jnp.zeros(num_p.shape + (1,), idx_p.dtype)
        self.Bm, self.Hm, nqb = num_p.shape  # [batch or 1, heads or 1, query blocks]
        self.nkb = -(-N // BC)
        # Keys and values per (batch, head) the tables distinguish: with a table per query
        # head, each query head gathers its own; otherwise a kv head's block serves its group.
        self.Hk = H if self.Hm == H else Hkv
        self.Gk = H // self.Hk
        key, value = att.key, att.value
        if self.Hk != Hkv:
            key, value = (jnp.repeat(t, H // Hkv, axis=1) for t in (key, value))
        pad_keys = [(0, 0), (0, 0), (0, self.nkb * BC - N), (0, 0)]
        self.key, self.value = jnp.pad(key, pad_keys), jnp.pad(value, pad_keys)
        self.ngroups = -(-nqb // group)
        self.extra = self.ngroups * group - nqb  # query blocks past the end list nothing
        self.rows_pad = self.ngroups * group * BR
        self.tables = [self._grouped_table(t.astype(jnp.int32)) for t in (num_p, idx_p, num_f, idx_f)]
        self.score = _block_grid(ctx, att.score_gm, B, H, True, len(att.score_bufs))
        self.mask = _block_grid(ctx, att.mask_gm, B, H, False, len(att.mask_bufs))

    def _grouped_table(self, t):  # [Bm, Hm, nqb, ...] -> [ngroups, Bm, Hm, group, ...]
        t = jnp.pad(t, [(0, 0), (0, 0), (0, self.extra)] + [(0, 0)] * (t.ndim - 3))
        return jnp.moveaxis(t.reshape((self.Bm, self.Hm, self.ngroups, self.group) + t.shape[3:]), 2, 0)

    def grouped(self, x, fill=0):
        """[B, H, M, ...] -> [ngroups, B, H, group, BR, ...], rows past M filled with `fill`."""
        att = self.att
        x = jnp.pad(x, [(0, 0), (0, 0), (0, self.rows_pad - att.M)] + [(0, 0)] * (x.ndim - 3),
                    constant_values=fill)
        return jnp.moveaxis(x.reshape((att.B, att.H, self.ngroups, self.group, self.BR) + x.shape[3:]), 2, 0)

    def ungrouped(self, x):
        """[ngroups, B, H, group, BR, ...] -> [B, H, M, ...]."""
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape((self.att.B, self.att.H, self.rows_pad) + x.shape[5:])[:, :, :self.att.M]

    def rows(self, c):
        """The query indices of group c, [group, BR] (past the end: the last row's)."""
        first = (c * self.group + jnp.arange(self.group, dtype=jnp.int32))[:, None] * self.BR
        return jnp.minimum(first + jnp.arange(self.BR, dtype=jnp.int32), self.att.M - 1)

    def blocks(self, t, tables):
        """Step t's key block of each query block: (block index [Bm, Hm, group], its key indices
        [Bm, Hm, group, BC], which of them count, whether the block is a full one)."""
        n_p, i_p, n_f, i_f = tables
        partial = t < n_p
        j = t - n_p
        full = ~partial & (j < n_f)
        kb = jnp.where(partial, lax.dynamic_index_in_dim(i_p, jnp.minimum(t, i_p.shape[-1] - 1), -1, False),
                       jnp.take_along_axis(i_f, jnp.clip(j, 0, i_f.shape[-1] - 1)[..., None], axis=-1)[..., 0])
        cols = kb[..., None] * self.BC + jnp.arange(self.BC, dtype=jnp.int32)
        valid = (partial | full)[..., None] & (cols < self.att.N) & (kb[..., None] >= 0)
        return kb, cols, valid, full

    def _one_block(self):
        return self.Bm == self.Hm == self.group == 1

    def _start(self, kb):
        """Where the one visited block starts (`_one_block`)."""
        return jnp.clip(kb[0, 0, 0], 0, self.nkb - 1) * self.BC

    def _keys(self, cols):
        """The visited keys per (batch, kv head), [B, Hk, group * BC], clipped into the keys."""
        at = jnp.clip(cols, 0, self.nkb * self.BC - 1).reshape(self.Bm, self.Hm, self.group * self.BC)
        return jnp.broadcast_to(at, (self.att.B, self.Hk, self.group * self.BC))

    def gather(self, kb, cols, x):
        """The blocks of x [B, Hk, keys, ...] the (batch, head)s visit: [B, Hk, group, BC, ...]."""
        if self._one_block():  # one block for everyone: a slice, not a gather
            return lax.dynamic_slice_in_dim(x, self._start(kb), self.BC, axis=2)[:, :, None]
        out = jnp.take_along_axis(x, self._keys(cols)[..., None], axis=2)
        return out.reshape((self.att.B, self.Hk, self.group, self.BC) + x.shape[3:])

    def scatter_add(self, kb, cols, acc, update):
        """acc [B, Hk, keys, ...] with update [B, Hk, group, BC, ...] added at the visited keys."""
        if self._one_block():
            start = self._start(kb)
            old = lax.dynamic_slice_in_dim(acc, start, self.BC, axis=2)
            return lax.dynamic_update_slice_in_dim(acc, old + update[:, :, 0].astype(acc.dtype), start, axis=2)
        at = self._keys(cols)
        update = update.reshape(at.shape + update.shape[4:]).astype(acc.dtype)
        add = jax.vmap(jax.vmap(lambda a, i, u: a.at[i].add(u)))  # duplicates (two query blocks) add up
        return add(acc, at, update)

    def by_kv_head(self, x):  # [B, H, ...] -> [B, Hk, Gk, ...]
        return x.reshape((self.att.B, self.Hk, self.Gk) + x.shape[2:])

    def rows_by_cols(self, x, blk, dtype):
        """x [B, H, group, BR, E] . blk [B, Hk, group, BC, E] over E -> [B, H, group, BR, BC]."""
        out = lax.dot_general(self.by_kv_head(x), blk, (((5,), (4,)), ((0, 1, 3), (0, 1, 2))),
                              precision=matmul_precision(x.dtype), preferred_element_type=dtype)
        return jnp.swapaxes(out, 2, 3).reshape(x.shape[:4] + (blk.shape[3],))

    def rows_times(self, x, blk, dtype):
        """x [B, H, group, BR, BC] . blk [B, Hk, group, BC, D] over BC -> [B, H, group, BR, D]."""
        out = lax.dot_general(self.by_kv_head(x), blk, (((5,), (3,)), ((0, 1, 3), (0, 1, 2))),
                              precision=matmul_precision(x.dtype), preferred_element_type=dtype)
        return jnp.swapaxes(out, 2, 3).reshape(x.shape[:4] + (blk.shape[-1],))

    def cols_times(self, x, y, dtype):
        """x^T [B, H, group, BC, BR] . y [B, H, group, BR, D], summed over each kv head's group
        of query heads: [B, Hk, group, BC, D]."""
        return lax.dot_general(self.by_kv_head(x), self.by_kv_head(y), (((2, 4), (2, 4)), ((0, 1, 3), (0, 1, 3))),
                               precision=matmul_precision(x.dtype), preferred_element_type=dtype)

    def kept(self, rows, cols, valid, full):
        """Which scores of the step's blocks count, [B, H, group, BR, BC], and mask_mod's code."""
        att = self.att

        def allowed():
            return self.mask(rows, jnp.minimum(cols, att.N - 1), *att.mask_bufs)

        if self._one_block():  # one block for everyone: mask_mod only where it is a partial one
            shape = (att.B, att.H, self.group, self.BR, self.BC)
            ok, code = lax.cond(full[0, 0, 0], lambda: (jnp.ones(shape, jnp.bool_), no_failure()), allowed)
        else:
            ok, code = allowed()
        return valid[..., None, :] & (ok | full[..., None, None]), code

    def loop(self, body, state, tables):
        """Runs body(t, state) over the steps the group's query blocks need."""
        n_p, _, n_f, _ = tables
        steps = jnp.max(n_p + n_f)
        _, state = lax.while_loop(lambda ts: ts[0] < steps, lambda ts: (ts[0] + 1, body(ts[0], ts[1])),
                                  (jnp.asarray(0, jnp.int32), state))
        return state


def _walk_forward(ctx, att, query, block_mask, group: int):
    """The forward over the listed blocks only, with an online softmax (running maximum, sum
    and output in the working precision, the probabilities rounded to the inputs' dtype before
    V, as the kernels do). Returns (out, logsumexp, row maxima) as the dense path does
    (natural log), and the first failed check's code."""
    walk = _Walk(ctx, att, block_mask, group)
    B, H, wp, dtype = att.B, att.H, att.wp, att.dtype
    BR, D = walk.BR, att.value.shape[-1]
    neg_inf, zero = jnp.asarray(-jnp.inf, wp), jnp.asarray(0, wp)

    def group_step(_, xs):
        c, q_blk, tables = xs
        rows = walk.rows(c)

        def kv_step(t, state):
            m, l, acc, code = state
            kb, cols, valid, full = walk.blocks(t, tables)
            s = walk.rows_by_cols(q_blk, walk.gather(kb, cols, walk.key).astype(wp), wp) * att.scale
            modded, score_code = walk.score(s, rows, jnp.minimum(cols, att.N - 1), *att.score_bufs)
            keep, mask_code = walk.kept(rows, cols, valid, full)
            post = jnp.where(keep, modded.astype(wp), neg_inf)
            m_new = jnp.maximum(m, jnp.max(post, axis=-1))
            shift = jnp.where(m_new == neg_inf, zero, m_new)
            p = jnp.exp(post - shift[..., None])
            alpha = jnp.exp(m - shift)  # 0 while m is -inf
            l = l * alpha + jnp.sum(p, axis=-1)
            acc = acc * alpha[..., None] + walk.rows_times(p.astype(dtype), walk.gather(kb, cols, walk.value), wp)
            code = _first_code(jnp.stack([code, mask_code, score_code]))
            return m_new, l, acc, code

        shape = (B, H, group, BR)
        m, l, acc, code = walk.loop(kv_step, (jnp.full(shape, -jnp.inf, wp), jnp.zeros(shape, wp),
                                              jnp.zeros(shape + (D,), wp), no_failure()), tables)
        dead = l == zero  # every score of the row masked: output 0, logsumexp -inf
        out = jnp.where(dead[..., None], zero, acc / jnp.where(dead, 1, l)[..., None]).astype(dtype)
        lse = jnp.where(dead, neg_inf, m + jnp.log(jnp.where(dead, 1, l)))
        return None, (out, lse, m, code)

    xs = (jnp.arange(walk.ngroups, dtype=jnp.int32), walk.grouped(query.astype(wp)), walk.tables)
    _, (out, lse, top, codes) = lax.scan(group_step, None, xs)
    return walk.ungrouped(out), walk.ungrouped(lse), walk.ungrouped(top), _first_code(codes)


def _walk_backward(ctx, att, block_mask, group, modded, diff_bufs, query, grad_out, lse, delta):
    """The backward over the listed blocks only: the dense formula block by block, dQ summed
    over a query block's steps, dK and dV (and the captured tensors' gradients) added at the
    keys each step visits. `lse` is the natural-log logsumexp ([B, H, M], -inf where a row saw
    no key), `delta` rowsum(O dO) less the logsumexp's incoming gradient. Returns (dQ, dK, dV
    over the walk's heads and padded keys, the buffers' gradients, the first failed check's
    code)."""
    walk = _Walk(ctx, att, block_mask, group)
    B, H, wp, dtype = att.B, att.H, att.wp, att.dtype
    neg_inf, zero = jnp.asarray(-jnp.inf, wp), jnp.asarray(0, wp)
    keys = walk.key.shape[2]

    def group_step(carry, xs):
        c, q_blk, go_blk, lse_blk, delta_blk, tables = xs
        rows = walk.rows(c)
        dead = lse_blk == neg_inf
        shift = jnp.where(dead, zero, lse_blk)

        def kv_step(t, state):
            dq, (dk, dv, bufs), code = state
            kb, cols, valid, full = walk.blocks(t, tables)
            k_blk, v_blk = walk.gather(kb, cols, walk.key), walk.gather(kb, cols, walk.value)
            s = walk.rows_by_cols(q_blk.astype(wp), k_blk.astype(wp), wp) * att.scale
            idx = jnp.minimum(cols, att.N - 1)
            post, pull, score_code = jax.vjp(lambda s, *b: modded(walk.score, s, rows, idx, *b), s, *diff_bufs,
                                             has_aux=True)
            keep, mask_code = walk.kept(rows, cols, valid, full)
            p = jnp.exp(jnp.where(keep, post, neg_inf) - shift[..., None])
            p = jnp.where(dead[..., None], zero, p)
            dp = walk.rows_by_cols(go_blk.astype(wp), v_blk.astype(wp), wp)
            ds = jnp.where(keep, p * (dp - delta_blk[..., None]), zero)
            grad_s, *grad_bufs = pull(ds)
            grad_s = jnp.where(keep, grad_s * att.scale, zero).astype(dtype)
            dq = dq + walk.rows_times(grad_s, k_blk.astype(dtype), wp)
            dk = walk.scatter_add(kb, cols, dk, walk.cols_times(grad_s, q_blk.astype(dtype), wp))
            dv = walk.scatter_add(kb, cols, dv, walk.cols_times(p.astype(dtype), go_blk.astype(dtype), wp))
            bufs = [a + g.astype(a.dtype) for a, g in zip(bufs, grad_bufs)]
            code = _first_code(jnp.stack([code, mask_code, score_code]))
            return dq, (dk, dv, bufs), code

        dq = jnp.zeros(q_blk.shape, wp)
        dq, carry, code = walk.loop(kv_step, (dq, carry, no_failure()), tables)
        return carry, (dq, code)

    carry = (jnp.zeros((B, walk.Hk, keys, query.shape[-1]), wp), jnp.zeros((B, walk.Hk, keys, att.value.shape[-1]), wp),
             [jnp.zeros(b.shape, _working(b.dtype)) for b in diff_bufs])
    xs = (jnp.arange(walk.ngroups, dtype=jnp.int32), walk.grouped(query), walk.grouped(grad_out),
          walk.grouped(lse, -jnp.inf), walk.grouped(delta), walk.tables)
    (dk, dv, bufs), (dq, codes) = lax.scan(group_step, carry, xs)
    return walk.ungrouped(dq), dk, dv, bufs, walk.Hk, _first_code(codes)


def _buffer_grads(ctx, diff, grads) -> tuple:
    """The captured tensors' gradients in the op's form: one per captured tensor, None where it
    gets none."""
    out = [None] * len(ctx.out[3])
    for i, g in zip(diff, grads):
        out[i] = g
    return tuple(out)


def _record(ctx, codes):
    if ctx.checks is not None:
        ctx.checks.add_code(_first_code(jnp.stack([jnp.asarray(c, CODE_DTYPE) for c in codes])))


@register_lowering(higher_order.flex_attention, subgraphs=_forward_subgraphs,
                   accepts=_accepts(_forward_subgraphs))
def _flex_attention(ctx, query, key, value, score_mod, block_mask, scale, kernel_options,
                    score_mod_other_buffers=(), mask_mod_other_buffers=()):
    att = _Attention(ctx, query, key, value, score_mod, block_mask, scale,
                     score_mod_other_buffers, mask_mod_other_buffers)
    wp = att.wp
    f32 = jnp.float32
    group = walk_plan(ctx.platform, att.B, att.H, att.M, att.N, block_mask)
    if group is not None:
        out, lse, top, code = _walk_forward(ctx, att, query, block_mask, group)
        _record(ctx, [code])
        return out, (lse / LN2).astype(f32), (top / LN2).astype(f32)
    neg_inf, zero, one = (jnp.asarray(x, wp) for x in (-jnp.inf, 0, 1))

    def step(rows, q, carry):
        keep, mask_code = att.kept(rows)
        modded, score_code = att.score(att.scores(q), rows, *att.score_bufs)
        post = jnp.where(keep, modded.astype(wp), neg_inf)
        top = jnp.max(post, axis=-1)
        dead = top == neg_inf  # every score of the row masked: output 0, logsumexp -inf
        shift = jnp.where(dead, zero, top)
        p = jnp.exp(post - shift[..., None])
        total = jnp.where(dead, one, jnp.sum(p, axis=-1))
        lse = jnp.where(dead, neg_inf, shift + jnp.log(total))
        out = att.rows_times((p / total[..., None]).astype(att.dtype), att.value.astype(att.dtype))
        codes = jnp.stack([mask_code, score_code])
        return carry, [out, lse, top, codes]

    _, (out, lse, top, codes) = att.over_rows(step, [(query, 0)])
    _record(ctx, [codes])
    return out, (lse / LN2).astype(f32), (top / LN2).astype(f32)


@register_lowering(higher_order.flex_attention_backward, subgraphs=_backward_subgraphs,
                   accepts=_accepts(_backward_subgraphs))
def _flex_attention_backward(ctx, query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                             fw_graph, joint_graph, block_mask, scale, kernel_options,
                             score_mod_other_buffers=(), mask_mod_other_buffers=()):
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"flex_attention backward needs query, key and value of one dtype, got "
                         f"{query.dtype}, {key.dtype} and {value.dtype} (as eager)")
    att = _Attention(ctx, query, key, value, fw_graph, block_mask, scale,
                     score_mod_other_buffers, mask_mod_other_buffers)
    wp, dtype = att.wp, att.dtype
    neg_inf, zero = jnp.asarray(-jnp.inf, wp), jnp.asarray(0, wp)
    # Which captured tensors get a gradient: those torch's meta gives one (they require grad).
    diff = [i for i, m in enumerate(ctx.out[3]) if isinstance(m, torch.Tensor)]
    if grad_out is None:
        grad_out = jnp.zeros(out.shape, out.dtype)
    if grad_logsumexp is None:
        grad_logsumexp = jnp.zeros(logsumexp.shape, jnp.float32)
    group = walk_plan(ctx.platform, att.B, att.H, att.M, att.N, block_mask)
    if group is not None:
        return _backward_by_walk(ctx, att, block_mask, group, diff, query, out, grad_out, logsumexp,
                                 grad_logsumexp)
    key_d, value_wp = att.key.astype(dtype), att.value.astype(wp)

    def modded(s, rows, *diff_bufs):
        values, code = att.score(s, rows, *att.with_buffers(diff, diff_bufs))
        return values.astype(wp), code

    def step(rows, q, o, go, lse, glse, carry):
        keep, mask_code = att.kept(rows)
        post, pull, score_code = jax.vjp(lambda s, *bufs: modded(s, rows, *bufs), att.scores(q),
                                         *[att.score_bufs[i] for i in diff], has_aux=True)
        lse = lse.astype(wp) * jnp.asarray(LN2, wp)
        dead = lse == neg_inf  # (padded rows too: nothing flows from them)
        p = jnp.exp(jnp.where(keep, post, neg_inf) - jnp.where(dead, zero, lse)[..., None])
        p = jnp.where(dead[..., None], zero, p)
        go_wp = go.astype(wp)
        dp = att.times_values(go_wp, value_wp)  # dO V^T, [B, H, R, N]
        ds = dp - jnp.sum(o.astype(wp) * go_wp, axis=-1, keepdims=True)
        ds = ds + (glse.astype(wp) / jnp.asarray(LN2, wp))[..., None]
        ds = jnp.where(keep, p * ds, zero)
        grad_s, *grad_bufs = pull(ds)
        grad_s = jnp.where(keep, grad_s * att.scale, zero).astype(dtype)
        grad_k, grad_v, bufs = carry
        grad_k = grad_k + att.cols_times(grad_s, q.astype(dtype))
        grad_v = grad_v + att.cols_times(p.astype(dtype), go.astype(dtype))
        bufs = [a + g.astype(a.dtype) for a, g in zip(bufs, grad_bufs)]
        grad_q = att.rows_times(grad_s, key_d)
        codes = jnp.stack([mask_code, score_code])
        return (grad_k, grad_v, bufs), [grad_q, codes]

    kv_shape = (att.B, att.Hkv, att.N)
    carry = (jnp.zeros(kv_shape + (key.shape[-1],), wp), jnp.zeros(kv_shape + (value.shape[-1],), wp),
             [jnp.zeros(att.score_bufs[i].shape, _working(att.score_bufs[i].dtype)) for i in diff])
    rows_in = [(query, 0), (out, 0), (grad_out, 0), (logsumexp, -jnp.inf), (grad_logsumexp, 0)]
    (grad_k, grad_v, bufs), (grad_q, codes) = att.over_rows(step, rows_in, carry)
    _record(ctx, [codes])
    return grad_q, att.kv_grad(grad_k), att.kv_grad(grad_v), _buffer_grads(ctx, diff, bufs)


def _backward_by_walk(ctx, att, block_mask, group, diff, query, out, grad_out, logsumexp, grad_logsumexp):
    """flex_attention_backward's results from `_walk_backward`, in the op's form."""
    wp, B, Hkv, N = att.wp, att.B, att.Hkv, att.N

    def modded(grid, s, rows, cols, *diff_bufs):
        values, code = grid(s, rows, cols, *att.with_buffers(diff, diff_bufs))
        return values.astype(wp), code

    lse = logsumexp.astype(wp) * jnp.asarray(LN2, wp)
    delta = (jnp.sum(out.astype(wp) * grad_out.astype(wp), axis=-1)
             - grad_logsumexp.astype(wp) / jnp.asarray(LN2, wp))
    grad_q, grad_k, grad_v, bufs, Hk, code = _walk_backward(
        ctx, att, block_mask, group, modded, [att.score_bufs[i] for i in diff], query, grad_out, lse, delta)
    _record(ctx, [code])
    grad_k, grad_v = grad_k[:, :, :N], grad_v[:, :, :N]
    if Hk != Hkv:  # a gradient per query head: summed over each kv head's group
        grad_k, grad_v = (g.reshape((B, Hkv, Hk // Hkv) + g.shape[2:]).sum(axis=2) for g in (grad_k, grad_v))
    return grad_q, att.kv_grad(grad_k), att.kv_grad(grad_v), _buffer_grads(ctx, diff, bufs)
