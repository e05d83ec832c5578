"""The torch reference of a model too large to hold, run one block at a time.

    outs = layerwise_run(source, [steps_a, steps_b])   # per session, per step: {"logits": ...},
                                                       # the last step also the caches written

Every session's steps go through block 0, then block 1, ...: one block's weights (read from
the memory-mapped checkpoint, models/weights.py) are alive at a time, and what is kept
between blocks is the hidden state of every step (a few tokens) and the cache slots the
steps wrote. The result is the same computation as Decoder.forward over a cache, step by
step. The steps of a session are fixed in advance (teacher-forced: they do not depend on the
outputs), so a session whose steps follow each other runs as ONE forward over all its tokens
(one_forward): the same positions, masks and cache slots, and the causal mask lets no token
read a later one, so each token's outputs are the step's, up to fp32 summation order; and the
rows from slot 0 of every session run packed in one sequence (_Plan). Each forward reads (and
MKL packs) every weight: on a 2-core AVX2 CPU a 2048 x 8192 weight costs 16 ms a forward of 6
tokens, 30 ms one of 48, so few forwards of many tokens are what makes the reference cheap.
Used by every build's verification (export/pipeline.py).
"""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from core.contract import CACHE_KINDS, cache_name, present_name
from models.decoder import StepInputs, embed_tokens, finish_logits, rotary_embeddings, step_inputs


def used_slots(steps) -> int:
    """Cache slots the steps of a session write: the caches are compared up to here."""
    return int(max((s.position + s.input_ids.shape[1]).max() for s in steps))


class ModelParts:
    """What the layer-by-layer run reads from a WeightSource: the model as the checkpoint holds it.
    A subclass may hand out other weights for the same structure (export/quant_reference.py's GraphWeights:
    the graph's own dequantized weights, the reference of a quantized graph)."""

    def __init__(self, source):
        self.source, self.cfg, self.skeleton = source, source.cfg, source.skeleton

    def embedding(self) -> torch.Tensor:
        return self.source.tensor("wte.weight")                                  # [V, d]

    def embedded(self, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """The embedding rows of each token-id tensor ([B, T] -> [B, T, d]); a subclass may read only those rows."""
        table = self.embedding()
        return [F.embedding(i, table) for i in ids]

    def positions(self) -> torch.Tensor:
        return self.source.tensor("wpe.weight")                                  # [S, d]

    def block(self, i: int) -> torch.nn.Module:
        return self.source.block(i)

    def final(self) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor | None]:
        """The final norm (a module), the LM head [V, d] and its bias [V] (None: none; a fold may add one)."""
        ln_f = copy.deepcopy(self.skeleton.ln_f)
        if any(True for _ in ln_f.parameters()):
            ln_f = self.source.fill(ln_f, "ln_f.")
        return ln_f, self.source.tensor("lm_head.weight"), None


def one_forward(steps, switch: int | None = None) -> list:
    """A session's Steps as one Step when each starts, on every row, where the previous one ended (their tokens
    side by side from the first step's slots); else the Steps as they are. `switch`: longrope's switch length
    (a forward reaching past it reads the long factors; long_switch), which the one Step must not reach past
    where a step alone would not."""
    from core.decode import Step
    follow = all(np.array_equal(b.position, a.position + a.input_ids.shape[1]) for a, b in zip(steps, steps[1:]))
    if len(steps) == 1 or not follow or (switch is not None and used_slots(steps) > switch):
        return list(steps)
    return [Step(np.concatenate([s.input_ids for s in steps], axis=1), steps[0].position)]


def long_switch(rotaries: dict) -> int | None:
    """The length past which a forward's rotary tables change (longrope's long factors; None: never)."""
    return min((r.switch_after for r in rotaries.values() if r.switch_after is not None), default=None)


class _Plan:
    """What a layerwise run computes for its sessions, each row once, in as few forwards as it can.

    A session run as one forward (one_forward) is cut into its rows; a row whose tokens begin another row's from
    the same slot is that row's beginning (causal: a token's outputs depend on the tokens up to it alone), so the
    build's real-text rows and the transformers check's row are the first tokens of the agreement prompt's row.
    The rows left from slot 0 run side by side in ONE sequence (`packed`: packed_inputs keeps each to itself), so
    every weight is read once for all their tokens; `separate`: what runs as it is (the sessions whose steps do
    not follow each other, and the other rows, one a session). `outputs` puts the outputs back into the sessions
    asked for."""

    def __init__(self, sessions, switch: int | None):
        from core.decode import Step
        self.sessions = sessions
        self.forwards = [one_forward(steps, switch) for steps in sessions]
        rows = [(s, b) for s, f in enumerate(self.forwards) if len(f) == 1 for b in range(f[0].input_ids.shape[0])]
        self.host = {row: self._longest(row, rows) for row in rows}
        hosts = list(dict.fromkeys(self.host.values()))
        # packed: the rows from slot 0 (a row from slot p > 0 also attends to the p slots before it, empty in
        # its own forward: it runs alone) that stay short of longrope's switch
        self.pack = [h for h in hosts if self._start(h) == 0 and (switch is None or len(self._ids(h)) <= switch)]
        self.alone = [h for h in hosts if h not in self.pack]
        self.rows = [(0, len(self._ids(h))) for h in self.pack]                    # (first slot, tokens)
        self.whole = {s: k for k, s in enumerate(s for s, f in enumerate(self.forwards) if len(f) > 1)}
        self.packed = [Step(np.concatenate([self._ids(h) for h in self.pack])[None], np.zeros(1, np.int64))] \
            if self.pack else None
        self.separate = [self.forwards[s] for s in self.whole] + \
            [[Step(self._ids(h)[None], np.array([self._start(h)], np.int64))] for h in self.alone]

    def _ids(self, row) -> np.ndarray:
        s, b = row
        return self.forwards[s][0].input_ids[b]

    def _start(self, row) -> int:
        s, b = row
        return int(self.forwards[s][0].position[b])

    def _longest(self, row, rows):
        """The longest row from the same slot whose tokens begin with `row`'s tokens (of equals, the first: rows
        alike share one)."""
        ids, start = self._ids(row), self._start(row)
        covering = [o for o in rows if self._start(o) == start and len(self._ids(o)) >= len(ids)
                    and np.array_equal(self._ids(o)[:len(ids)], ids)]
        return min(covering, key=lambda o: (-len(self._ids(o)), o))

    def outputs(self, separate: list[list[dict]], packed: list[dict] | None) -> list[list[dict]]:
        """Every session's outputs (layerwise_run's) from those of `separate` and of the packed forward (each run's
        per step, its caches cut to its own slots)."""
        hosts = dict(zip(self.pack, self._unpacked(packed[0]) if packed is not None else []))
        hosts.update(zip(self.alone, (run[0] for run in separate[len(self.whole):])))
        out = []
        for s, steps in enumerate(self.sessions):
            if s in self.whole:
                out.append(separate[self.whole[s]])
                continue
            rows = [self._row_outputs(hosts[self.host[(s, b)]], (s, b), used_slots(steps))
                    for b in range(steps[0].input_ids.shape[0])]
            merged = {name: np.concatenate([r[name] for r in rows]) for name in rows[0]}
            out.append(_split(merged, steps))
        return out

    def _unpacked(self, packed: dict) -> list[dict]:
        """Each packed row's outputs out of the packed forward's: its tokens' logits and cache slots (a row from
        slot 0: its slots are its own tokens')."""
        hosts, offset = [], 0
        for _, n in self.rows:
            hosts.append({name: value[:, offset:offset + n] if name == "logits" else value[:, :, offset:offset + n]
                          for name, value in packed.items()})
            offset += n
        return hosts

    def _row_outputs(self, host: dict, row, used: int) -> dict:
        """One row's outputs out of its host row's: the first tokens' logits; in the caches, the slots the row
        writes (the others zero, as a run of its own leaves them), `used` slots."""
        n, start = len(self._ids(row)), self._start(row)
        got = {"logits": host["logits"][:, :n]}
        for name, cache in host.items():
            if name != "logits":
                mine = np.zeros(cache.shape[:2] + (used,) + cache.shape[3:], cache.dtype)
                mine[:, :, start:start + n] = cache[:, :, start:start + n]
                got[name] = mine
        return got


def _split(merged: dict, steps) -> list[dict]:
    """The outputs of a session run as one forward, cut back into its steps: each step its logits, the last
    also the caches."""
    cuts = np.cumsum([s.input_ids.shape[1] for s in steps])[:-1]
    split = [{"logits": np.ascontiguousarray(x)} for x in np.split(merged["logits"], cuts, axis=1)]
    split[-1].update({k: v for k, v in merged.items() if k != "logits"})
    return split


def _batched(sessions) -> tuple[list, list[tuple[int, int, int]]]:
    """The sessions as few as possible: those with the same steps' lengths side by side in one batch (each
    sequence has its own positions, so they stay independent), and where each session's rows are:
    (group, first row, rows). Each step then reads every block's weights once for all of them."""
    from core.decode import Step
    groups: dict[tuple, list[int]] = {}
    for s, steps in enumerate(sessions):
        groups.setdefault(tuple(st.input_ids.shape[1] for st in steps), []).append(s)
    merged, where = [], [None] * len(sessions)
    for g, members in enumerate(groups.values()):
        row = 0
        for s in members:
            where[s] = (g, row, sessions[s][0].input_ids.shape[0])
            row += sessions[s][0].input_ids.shape[0]
        merged.append([Step(np.concatenate([sessions[s][t].input_ids for s in members]),
                            np.concatenate([sessions[s][t].position for s in members]))
                       for t in range(len(sessions[members[0]]))])
    return merged, where


def packed_inputs(cfg, rotaries: dict, rows: list[tuple[int, int]]) -> StepInputs:
    """The inputs of one forward of `rows` ((first slot, tokens) each) side by side in one sequence from slot 0,
    cache slot k holding the sequence's k-th token: each token at its own position, attending to its own row's
    tokens up to it (on a sliding layer, those within the window), the rule step_inputs makes for each row alone."""
    pos = torch.cat([torch.arange(start, start + n) for start, n in rows])                  # [L]
    row = torch.cat([torch.full((n,), r) for r, (_, n) in enumerate(rows)])
    key_pos = torch.full((cfg.max_seq_len,), -1)
    key_row = torch.full((cfg.max_seq_len,), -1)
    key_pos[:len(pos)], key_row[:len(row)] = pos, row
    mask = (key_row[None, :] == row[:, None]) & (key_pos[None, :] <= pos[:, None])          # [L, S]
    sliding = None
    if cfg.sliding_layers:
        sliding = (mask & (key_pos[None, :] > pos[:, None] - cfg.sliding_window))[None, None]
    used = {cfg.rope_kind(i) for i in range(cfg.n_layer)} - {None}
    return StepInputs(cfg, pos[None], mask[None, None], sliding, {k: rotaries[k](pos[None]) for k in sorted(used)})


@torch.no_grad()
def layerwise_run(source, sessions, dtype: torch.dtype = torch.float32, parts: ModelParts | None = None,
                  log=None) -> list[list[dict[str, np.ndarray]]]:
    """Outputs of the decode steps of each session (Step lists, export/conventions.py): logits of
    every step and, on the last step, present_key_i / present_value_i cut to the slots written
    ([B, H_kv, used_slots, D]). `parts`: where the weights come from (default: the checkpoint's).
    `log`: called with one progress line per block (a 1B model's reference takes a minute).
    The rows run packed in one sequence where they can (_Plan), the rest side by side (_batched), over caches
    as long as the slots they write (attention over the slots past them, always masked, would cost as much as
    the rest)."""
    cfg = source.cfg
    rotaries = rotary_embeddings(cfg)       # the model's (longrope's switch reads its capacity); the skeleton's
    plan = _Plan(sessions, long_switch(rotaries))
    merged, where = _batched(plan.separate)
    runs = merged + ([plan.packed] if plan.packed is not None else [])
    short = replace(cfg, max_seq_len=max(used_slots(steps) for steps in runs))          # masks and caches
    inputs = [[step_inputs(short, rotaries, torch.from_numpy(s.input_ids), torch.from_numpy(s.position))
               for s in steps] for steps in merged]
    if plan.packed is not None:
        inputs.append([packed_inputs(short, rotaries, plan.rows)])
    outs = _run(source, runs, inputs, short, dtype, parts or ModelParts(source), log, len(sessions))
    cut = [[{name: np.ascontiguousarray(value[row:row + rows] if name == "logits" else
                                        value[row:row + rows, :, :used_slots(steps)])
             for name, value in step.items()} for step in outs[g]]
           for (g, row, rows), steps in zip(where, plan.separate)]
    return plan.outputs(cut, outs[-1] if plan.packed is not None else None)


def _run(source, sessions, inputs, short, dtype, parts: ModelParts, log, labelled: int) -> list[list[dict]]:
    """The forwards of `sessions` (lists of Steps, their StepInputs in `inputs`) block by block, over caches of
    short.max_seq_len slots: per session, per step, its logits; the last step also its caches, cut to its slots."""
    cfg = source.cfg
    layout = short.cache_layout()
    ids = [[torch.from_numpy(s.input_ids) for s in steps] for steps in sessions]
    pos = [[torch.from_numpy(s.position) for s in steps] for steps in sessions]
    looked_up = iter(parts.embedded([i for ii in ids for i in ii]))
    xs = [[embed_tokens(cfg, next(looked_up).to(dtype)) for _ in ii] for ii in ids]      # [B, T, d] per step
    if cfg.pos_embedding == "learned":
        wpe = parts.positions().to(dtype)
        xs = [[x + wpe[inp.pos_ids] for x, inp in zip(xx, ii)] for xx, ii in zip(xs, inputs)]
        del wpe
    outs = [[{} for _ in steps] for steps in sessions]
    for i in range(cfg.n_layer):
        block = parts.block(i).to(dtype)
        for s, steps in enumerate(sessions):
            batch = steps[0].input_ids.shape[0]
            cache = (torch.zeros(layout.shape(batch), dtype=dtype),              # this layer's key, value [B, H_kv, S, D]
                     torch.zeros(layout.shape(batch), dtype=dtype))
            for t, step in enumerate(steps):
                mask, rope = inputs[s][t].layer(i)
                xs[s][t], cache = block(xs[s][t], mask, cache, pos[s][t], rope)
            used = used_slots(steps)
            for kind, c in zip(CACHE_KINDS, cache):
                outs[s][-1][present_name(cache_name(i, kind))] = c[:, :, :used].float().numpy().copy()
        del block
        if log is not None:
            log(f"      [{i + 1}/{cfg.n_layer}] block {i + 1} through {labelled} session(s)")
    ln_f, head, bias = parts.final()
    ln_f, head = ln_f.to(dtype), head.to(dtype)                                 # head [V, d]
    # every token of every step through the head at once: one pass over its weights (a real model's is ~1 GB)
    hidden = torch.cat([x.reshape(-1, x.shape[-1]) for xx in xs for x in xx])  # [tokens, d]
    logits = finish_logits(cfg, F.linear(ln_f(hidden), head, None if bias is None else bias.to(dtype)))
    logits = logits.float().numpy()
    start = 0
    for s, xx in enumerate(xs):
        for t, x in enumerate(xx):
            n = x.shape[0] * x.shape[1]
            outs[s][t]["logits"] = logits[start:start + n].reshape(x.shape[0], x.shape[1], -1)
            start += n
    return outs
