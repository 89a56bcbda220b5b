"""Context KV blocks kept across score calls (``evaluate.prefix_cache_mib``,
``evaluate.vllm.prefix_cache_mib``).

With ``share_prefix`` a score call forwards the context its pairs share once (the AlpacaEval judge's
prompt for its two verdicts), but every call forwards its own contexts from their first token: the
judge prompts of one instruction start with the same template, instruction and, in the order with
the reference first, the same reference output for every row of the stage (24 rows x 20 prompts in
the ``smollm2-135m`` tier, ~57% of their characters shared). :class:`PrefixBlockCache` computes a shared
context's key/value cache in blocks of :data:`PREFIX_BLOCK_TOKENS` tokens, each block on the blocks before it
(blocks of the same index in several contexts batched, equal lengths, no padding), and keeps the blocks,
keyed by every token up to their end, for later calls (least recently used dropped beyond the budget). This
is vLLM's automatic prefix caching (hash-chained blocks, LRU eviction) on the HF scorer.

Values do not depend on what the cache holds: a block's keys, values and final hidden states are computed
from the same inputs in the same shapes whether it is found or recomputed, and each batch row of a block's
forward gets the bits it gets alone (the batch only stacks independent rows; CPU BLAS and SDPA give each row
the same result at these sizes, which the tests check: a cold cache, a warm one, a budget that evicts all the
time and another call order give bitwise equal scores). On a GPU that row independence is not measured. Values
differ from the batched ``share_prefix`` forward at rounding level (another chunking of the same causal
computation; tested within 1e-6 relative on the tiny model, 1.1e-5 measured on SmolLM2-135M's ~1,000-token
judge prompts, verdicts equal), so the evaluate key names the block size where the cache acts.

A cache belongs to one set of weights: its blocks are keyed by tokens alone, so weights changed in place after
it was filled would be served stale keys and values. The pipeline never does that (heads are hooks after the
last layer); the HF backend keeps one cache per loaded model and the vLLM engine's HF copy drops its cache with
the copy. Tested in bfloat16 too (the test model on the CPU, `test_bfloat16_blocks_do_not_depend_on_the_cache`): the scores are as independent of the cache's
contents (bitwise) as in float32, within 1.6e-4 relative of the full forward.

Only the plain model is cached (no correction head: a head changes the final hidden states, not the
keys and values, and a head's scores do not share prefixes across calls in this pipeline) and only a
model whose cache holds every position of every layer (no sliding window: :func:`blocks_supported`).
"""

from __future__ import annotations

import collections
import hashlib
import logging
from typing import Callable, Sequence

import torch

log = logging.getLogger("darts_bench")

PREFIX_BLOCK_TOKENS = 64
"""Tokens per cached block: a context shares whole blocks only (the last partial block is forwarded with
each pair's own tokens). 64 keeps a block's matmuls large enough for CPU BLAS and wastes at most 63
shared tokens per context."""


def blocks_supported(model) -> bool:
    """Whether ``model``'s KV cache can be assembled from blocks: every layer a full-attention layer (no
    ``sliding_window`` in its config, or ``use_sliding_window`` off, and no non-``full_attention`` entry in
    ``layer_types``). Gemma-2 / Mistral-style sliding layers are not cached (their scores keep the batched
    ``share_prefix`` path)."""
    c = getattr(model, "config", None)
    if c is None:
        return False
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
        return False
    types = getattr(c, "layer_types", None)
    return not types or all(t == "full_attention" for t in types)


class PrefixBlockCache:
    """Key/value blocks of the contexts a model has forwarded, for the score calls after.

    Args:
        max_bytes: most bytes of blocks kept (keys, values and final hidden states); the least
            recently used go first (the newest block is kept even when it alone exceeds the budget; a
            call holds the blocks it uses until it returns, whatever the budget).
        block: tokens per block (None: :data:`PREFIX_BLOCK_TOKENS`, read when the cache is made).
        max_batch: most blocks computed in one forward (blocks of the same index in different contexts).
        max_batch_tokens: most tokens (the blocks' and the blocks' before them) in one such forward, at least one
            block: its past is stacked and then extended, two copies of ``[batch, kv_heads, tokens, head_dim]`` per
            layer (SmolLM2-135M fp32: 4,096 tokens ~ 2 x 190 MB; 16 blocks at index 20 would be 2 x 2.2 GB).

    Attributes:
        hits, misses: blocks a call found (made by an earlier call) / computed so far; ``forwarded``: tokens the
            blocks' forwards ran.
    """

    def __init__(self, max_bytes: int, block: int | None = None, max_batch: int = 16, max_batch_tokens: int = 4096):
        block = PREFIX_BLOCK_TOKENS if block is None else block
        if min(max_bytes, block, max_batch, max_batch_tokens) < 1:
            raise ValueError(f"prefix cache: max_bytes, block, max_batch and max_batch_tokens must be >= 1, got "
                             f"{max_bytes}, {block}, {max_batch}, {max_batch_tokens}")
        self.max_bytes, self.block, self.max_batch = int(max_bytes), int(block), int(max_batch)
        self.max_batch_tokens = int(max_batch_tokens)
        # chain digest -> (keys per layer [kv_heads, block, head_dim], values likewise, h [block, d_model], bytes)
        self._blocks: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.forwarded = 0

    @classmethod
    def from_mib(cls, mib: int) -> "PrefixBlockCache | None":
        """A cache of ``mib`` MiB (None for 0: off)."""
        return cls(int(mib) << 20) if mib else None

    def summary(self) -> str:
        """One line for the log: blocks found and computed, bytes held."""
        return (f"{self.hits} blocks of {self.block} tokens found, {self.misses} computed "
                f"({self.forwarded} tokens forwarded), {len(self._blocks)} held ({self.bytes / 2**20:.0f} MiB)")

    def log_use(self, what: str) -> None:
        """Log :meth:`summary` as ``prefix cache of <what>: ...`` once the cache has been used (the HF backend
        and the vLLM engine's HF copy, when they drop the model)."""
        if self.hits or self.misses:
            log.info("prefix cache of %s: %s", what, self.summary())

    def cut(self, n: int) -> int:
        """The tokens of an ``n``-token shared prefix that come from whole blocks."""
        return n // self.block * self.block

    def states(self, model, final_states: Callable, prefixes: Sequence[Sequence[int]]):
        """Final hidden states and KV cache of ``prefixes`` (each a whole number of blocks), left-padded
        to the longest, as a batched forward of them would give (``prefix_chunk``'s layout).

        Args:
            model: the causal LM (HF), plain (its forwards here run without a head).
            final_states: ``final_states(**forward kwargs) -> (h [batch, seq, d_model], KV cache)``:
                the scorer's forward returning the final norm's output.
            prefixes: token ids per group, each of length a multiple of :attr:`block` (may be 0).
        Returns:
            ``(h [G, P, d_model], cache)``: ``P`` the longest prefix; a shorter one's first positions
            are zeros (masked by the caller's left-padded attention mask); ``cache`` a
            ``transformers.DynamicCache`` with ``[G, kv_heads, P, head_dim]`` per layer.
        Raises:
            ValueError: a prefix that is not a whole number of blocks.
        """
        from transformers import DynamicCache

        per = self._gather(model, final_states, prefixes, count=False)  # found or made by the call's prefetch
        P = max(len(p) for p in prefixes)
        first = next(b for bl in per for b in bl)
        n_layers, (kvh, _, hd), d = len(first[0]), first[0][0].shape, first[2].shape[-1]
        ref = first[0][0]
        G = len(prefixes)
        keys = [ref.new_zeros(G, kvh, P, hd) for _ in range(n_layers)]
        values = [ref.new_zeros(G, kvh, P, hd) for _ in range(n_layers)]
        h = first[2].new_zeros(G, P, d)
        for g, bl in enumerate(per):
            start = P - len(bl) * self.block
            for j, (k, v, hb, _) in enumerate(bl):
                s = slice(start + j * self.block, start + (j + 1) * self.block)
                for i in range(n_layers):
                    keys[i][g, :, s] = k[i]
                    values[i][g, :, s] = v[i]
                h[g, s] = hb
        cache = DynamicCache(config=model.config)
        for i in range(n_layers):
            cache.update(keys[i], values[i], i)
        return h, cache

    def prefetch(self, model, final_states: Callable, prefixes: Sequence[Sequence[int]]) -> None:
        """Compute the missing blocks of ``prefixes`` (each a whole number of blocks) now, batched across
        them (a score call's prefixes before its chunks: one forward per block index and
        :attr:`max_batch` prefixes rather than one per chunk). As :meth:`states`, without the assembly."""
        self._gather(model, final_states, prefixes)

    def _gather(self, model, final_states: Callable, prefixes: Sequence[Sequence[int]],
                count: bool = True) -> list[list[tuple]]:
        """The blocks of each prefix: found, or computed block index by block index, up to
        :attr:`max_batch` prefixes per forward, each on its own blocks before (equal lengths: no padding).
        A block computed here is held for the call even if the budget evicts it from the cache. ``count``: add the
        blocks found to :attr:`hits` (not for a chunk's blocks after :meth:`prefetch` found or made them)."""
        from transformers import DynamicCache

        B = self.block
        digests: list[list[bytes]] = []
        for p in prefixes:
            if len(p) % B:
                raise ValueError(f"prefix cache: a prefix of {len(p)} tokens is not a whole number of {B}-token blocks")
            chain, d = [], b""
            for k in range(len(p) // B):
                d = hashlib.blake2b(d + torch.tensor(list(p[k * B:(k + 1) * B]), dtype=torch.int64).numpy().tobytes(),
                                    digest_size=16).digest()
                chain.append(d)
            digests.append(chain)
        have: dict[bytes, tuple] = {}
        dev = next(model.parameters()).device
        for k in range(max((len(c) for c in digests), default=0)):
            todo: dict[bytes, int] = {}  # a missing block -> the first prefix holding it
            for j, chain in enumerate(digests):
                if k >= len(chain) or chain[k] in have or chain[k] in todo:
                    continue
                got = self._blocks.get(chain[k])
                if got is not None:
                    self._blocks.move_to_end(chain[k])
                    self.hits += count
                    have[chain[k]] = got
                else:
                    todo[chain[k]] = j
            items = list(todo.items())
            per = max(1, min(self.max_batch, self.max_batch_tokens // ((k + 1) * B)))
            for s in range(0, len(items), per):
                part = items[s:s + per]
                n = len(part)
                kw = {"input_ids": torch.tensor([list(prefixes[j][k * B:(k + 1) * B]) for _, j in part],
                                                dtype=torch.long, device=dev),
                      "attention_mask": torch.ones(n, (k + 1) * B, dtype=torch.long, device=dev),
                      "position_ids": torch.arange(k * B, (k + 1) * B, device=dev)[None].expand(n, -1),
                      "use_cache": True}
                if k:
                    past = DynamicCache(config=model.config)
                    for i in range(len(have[digests[part[0][1]][0]][0])):
                        past.update(*(torch.stack([torch.cat([have[digests[j][q]][w][i] for q in range(k)], 1)
                                                   for _, j in part]) for w in (0, 1)), i)
                    kw.update(with_kv_cache(model, past))
                hb, cache = final_states(**kw)
                layers = cache_layers(cache)
                for r, (d, _) in enumerate(part):
                    ks = tuple(kk[r, :, k * B:].clone() for kk, _ in layers)
                    vs = tuple(vv[r, :, k * B:].clone() for _, vv in layers)
                    hr = hb[r].clone()
                    blk = (ks, vs, hr, sum(t.numel() * t.element_size() for t in (*ks, *vs, hr)))
                    have[d] = blk
                    self._blocks[d] = blk
                    self.bytes += blk[3]
                    self.misses += 1
                    self.forwarded += B
                while self.bytes > self.max_bytes and len(self._blocks) > 1:
                    _, old = self._blocks.popitem(last=False)
                    self.bytes -= old[3]
        return [[have[d] for d in chain] for chain in digests]


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` ``[batch, kv_heads, seq, head_dim]`` per layer of a transformers ``DynamicCache``
    (its ``layers``: transformers 5, which the project requires)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def with_kv_cache(model, cache) -> dict:
    """The forward keyword that passes a KV cache to ``model``: ``cache`` (transformers >= 5.20) or
    ``past_key_values`` (earlier 5.x, e.g. the vLLM venv's), whichever its ``forward`` takes."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def kv_cache_of(out):
    """The KV cache a forward returned (``cache`` or, before transformers 5.20, ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
