"""The planner's result, :class:`Plan`, and its presentation: the explanation, the table and the chart.

:func:`plan` estimates every valid sharding degree (:mod:`lightning_mics.plan.estimate`) and recommends one.

[Note: the recommendation]
Every layout the planner lists holds the same model and batch and does the same computation; what differs is
the memory per GPU and the communication per optimizer step. A layout over the budget is out; among those that
fit, memory left over buys nothing, and communication is time. So the planner recommends the layout with the
least communication it predicts per optimizer step (``comm_seconds``, estimate.py's ring model without overlap),
and between layouts within 1% of that, the smallest s (fewer ranks in each per-layer collective). The
explanation names the figures: the recommended layout's time and memory against every other layout that fits.
The smallest s that fits is often not the fastest: a small shard group leaves many replicas, and their gradient
all-reduce crosses the slow inter-node links (Llama-2-7B on 2 nodes of 8 GPUs with activation checkpointing:
s=2 fits at 54.3 GiB but predicts 3.86 s per step; s=8 predicts 0.694 s at 16.6 GiB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from lightning_mics.plan.estimate import LINKS, Estimate, degrees_to_plan, estimate
from lightning_mics.plan.models import ModelSpec, resolve
from lightning_mics.plan.settings import GiB, Settings, _fail


@dataclass
class Plan:
    """Every estimated degree of one model and settings, the recommended one ([Note: the recommendation]), notes."""

    model: ModelSpec
    settings: Settings
    estimates: List[Estimate]
    recommended: Optional[Estimate]
    notes: List[str] = field(default_factory=list)

    def estimate(self, s: int) -> Estimate:
        for e in self.estimates:
            if e.s == s:
                return e
        _fail("s", s, f"one of {[e.s for e in self.estimates]}")
        raise AssertionError

    def unit(self) -> Tuple[str, int]:
        """The size unit that suits this plan's figures: GiB, MiB or KiB."""
        top = max(e.total for e in self.estimates)
        return next((u for u in (("GiB", GiB), ("MiB", 2 ** 20)) if top >= u[1]), ("KiB", 2 ** 10))

    def table(self) -> str:
        name, div = self.unit()
        comm_name, comm_div = ("GB", 1e9) if name == "GiB" else ("MB", 1e6)
        head = (f"| s | t | r | model state {name} | activations {name} | gathered {name} | buffers {name} | "
                f"total {name} | intra-node {comm_name}/step | inter-node {comm_name}/step | "
                f"replica {comm_name}/step | comm s/step | fits |")
        lines = [head, "|" + "---|" * (head.count("|") - 1)]
        for e in self.estimates:
            act = f"{e.activations / div:.2f}" if e.activations is not None else "n/a"
            mark = "yes" if e.fits else "no"
            if e is self.recommended:
                mark = "**yes: recommended**"
            lines.append(f"| {e.s} | {e.t} | {e.r} | {e.model_state['total'] / div:.2f} | {act} | "
                         f"{e.gathered / div:.2f} | {e.buffers / div:.2f} | {e.total / div:.2f} | "
                         + " | ".join(f"{e.link_bytes[k] / comm_div:.3f}" for k in LINKS)
                         + f" | {e.comm_seconds:.3g} | {mark} |")
        return "\n".join(lines)

    def explain(self) -> str:
        st, m = self.settings, self.model
        name, div = self.unit()
        size = lambda n: f"{n / div:.3g} {name}"  # noqa: E731
        parts = lambda e: (f"model state {size(e.model_state['total'])} + " + (  # noqa: E731
            f"activations {size(e.activations)}" if e.activations is not None else "activations not estimated")
            + f" + gathered parameters and buffers {size(e.gathered + e.buffers)}")
        budget = self.estimates[0].budget
        count = f"{m.n_params / 1e9:.3g}B" if m.n_params >= 1e9 else f"{m.n_params / 1e6:.3g}M"
        out = [f"{m.name}: {count} parameters ({m.source}); {st.nodes} node(s) x {st.gpus_per_node} "
               f"GPUs of {st.gpu_memory_gib:g} GiB, t={st.tensor_parallel_degree}, {st.precision}, {st.optimizer}, "
               f"sequence {st.seq_len}, micro-batch {st.micro_batch}, accumulation {st.accumulation}, "
               f"activation checkpointing {'on' if st.activation_checkpointing else 'off'}"
               f"{' with offload' if st.activation_offload else ''}; budget {budget / GiB:.3g} GiB per GPU "
               f"({st.headroom:.0%} headroom)."]
        rec = self.recommended
        if rec is None:
            best = min(self.estimates, key=lambda e: e.total)
            out.append(f"No s fits: the least memory is s={best.s} with {size(best.total)} per GPU "
                       f"({parts(best)}). Use more GPUs, tensor parallelism, activation checkpointing (and offload) "
                       "or a smaller micro-batch.")
        else:
            out.append(f"Recommended s={rec.s} (r={rec.r} replicas): {size(rec.total)} per GPU ({parts(rec)}), "
                       f"{size(budget - rec.total)} under the budget.")
            out.append(self._why(rec, size))
            smaller = [e for e in self.estimates if e.s < rec.s and not e.fits]
            if smaller:
                e = smaller[-1]
                out.append(f"s={e.s} does not fit: {size(e.total)} ({parts(e)}).")
            lb = rec.link_bytes
            traffic = (f"Per optimizer step and GPU: {lb['intra-node'] / 1e9:.3g} GB intra-node, "
                       f"{lb['inter-node'] / 1e9:.3g} GB inter-node, {lb['replica'] / 1e9:.3g} GB across replicas; "
                       f"{rec.comm_seconds:.3g} s predicted without overlap.")
            if st.replica_sync == "diloco":  # [Note: planner DiLoCo] in estimate.py
                sync = rec.outer_sync.get("all_reduce/replicate", {"bytes": 0})["bytes"]
                f, every = st.sync_fragments, st.sync_every // st.sync_fragments
                traffic += (f" DiLoCo (sync_every={st.sync_every}): no replica traffic inside a window, one outer "
                            f"all-reduce of {sync / 1e9:.3g} GB every {st.sync_every} steps, counted as its mean "
                            "per step above; it is not exact data parallelism.") if f == 1 else \
                    (f" Streaming DiLoCo (sync_every={st.sync_every}, sync_fragments={f}): one fragment's all-reduce "
                     f"(at most {sync / 1e9:.3g} GB) every {every} steps, counted as their mean per step above; it "
                     "is not exact data parallelism.")
            if rec.s == 1 and st.shard_optimizer_state:
                out.append("At s=1 with shard_optimizer_state every GPU holds the whole parameters and gradients "
                           "and 1/W of the optimizer state (ZeRO-1): no per-layer collectives, one reduce-scatter "
                           "and one all-gather per optimizer step. " + traffic)
            elif rec.s == 1:
                out.append("At s=1 every GPU holds the whole model state (plain data parallelism): no per-layer "
                           "collectives, one gradient all-reduce per optimizer step. " + traffic)
            else:
                if rec.s <= st.dp_per_node:
                    where = "inside one node, on the intra-node links"
                else:
                    hops = " (two hops: the first across nodes, the second inside)" \
                        if st.hierarchical_allgather else ""
                    where = f"across {math.ceil(rec.s / st.dp_per_node)} nodes{hops}"
                out.append(f"A larger s shards further but puts more ranks into every per-layer all-gather and "
                           f"reduce-scatter and leaves fewer replicas. At s={rec.s} those stay {where}; replicas "
                           + (f"meet once every {st.sync_every} optimizer steps (DiLoCo's outer sync)"
                              if st.replica_sync == "diloco" else "meet once per optimizer step (")
                           + ("" if st.replica_sync == "diloco" else "a reduce-scatter at the accumulation boundary and "
                           "an all-gather of the updated rows after the step: with shard_optimizer_state each "
                           "replica steps 1/r of the shard" if st.shard_optimizer_state else
                           "the all-reduce at the accumulation boundary)") + ". " + traffic)
        out += self.notes + m.notes
        return "\n".join(out)

    def _why(self, rec: Estimate, size: Any) -> str:
        """[Note: the recommendation], with this plan's figures."""
        others = [e for e in self.estimates if e.fits and e is not rec]
        if not others:
            return f"It is the only layout that fits: {rec.comm_seconds:.3g} s of communication per optimizer step."
        figures = "; ".join(f"s={e.s}: {e.comm_seconds:.3g} s at {size(e.total)}" for e in others)
        return (f"Of the {len(others) + 1} layouts that fit, it predicts the least communication per optimizer step, "
                f"{rec.comm_seconds:.3g} s at {size(rec.total)} per GPU (the others: {figures}).")

    def __str__(self) -> str:
        return self.explain() + "\n\n" + self.table()

    def plot(self, path: str) -> None:
        """A PNG: memory per GPU against s, stacked by kind, with the GPU's memory and the budget."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        es = self.estimates
        xs = list(range(len(es)))
        parts = [("model state", [e.model_state["total"] for e in es]),
                 ("activations", [e.activations or 0 for e in es]),
                 ("gathered params + buffers", [e.gathered + e.buffers for e in es])]
        fig, ax = plt.subplots(figsize=(7, 4))
        bottom = [0.0] * len(es)
        for label, vals in parts:
            ax.bar(xs, [v / GiB for v in vals], bottom=bottom, label=label)
            bottom = [b + v / GiB for b, v in zip(bottom, vals)]
        ax.axhline(self.settings.gpu_memory_gib, color="k", lw=1, label="GPU memory")
        ax.axhline(es[0].budget / GiB, color="r", lw=1, ls="--", label="budget (headroom)")
        ax.set_xticks(xs, [f"s={e.s}" + (" *" if e is self.recommended else "") for e in es])
        ax.set_ylabel("GiB per GPU")
        mem = self.settings.gpu_memory_gib
        top = max(1.5 * mem, min(max(bottom), 3 * mem)) * 1.05  # bars far above the GPU are cut, labelled
        ax.set_ylim(0, top)
        for x, total in zip(xs, bottom):
            ax.text(x, min(total, top * 0.93), f"{total:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{self.model.name}: memory per GPU vs sharding degree (* recommended)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _tensor_parallel_notes(spec: ModelSpec, st: Settings) -> List[str]:
    if st.tensor_parallel_degree == 1:
        return []
    if not any(p.tp for u in spec.units for p in u.params):
        return [f"t={st.tensor_parallel_degree}, but no parameter of this model is marked tensor-parallel: "
                "plan a module after parallelizing it (its DTensor parameters) or a transformer layout."]
    return [f"t={st.tensor_parallel_degree}: the tensor-parallel parts are those of "
            + ("the module's own plan." if spec.source.startswith("nn.Module") else
               "a Megatron-style plan (attention and MLP column- then row-parallel, embeddings and head "
               "split on the vocabulary, norms whole).")]


def choose(estimates: Sequence[Estimate]) -> Optional[Estimate]:
    """[Note: the recommendation]: among the layouts that fit, the least predicted communication per optimizer
    step; between those within 1% of it, the smallest s."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None
    least = min(e.comm_seconds for e in fitting)
    return min((e for e in fitting if e.comm_seconds <= least * 1.01), key=lambda e: e.s)


def plan(model: Any, *, instance: Optional[str] = None, degrees: Optional[Sequence[int]] = None,
         shard_units: Optional[List[Any]] = None, **settings: Any) -> Plan:
    """Plans every valid sharding degree s (divisors of the data-parallel world) and recommends, among those that
    fit with headroom, the one with the least predicted communication ([Note: the recommendation]). ``model``: see
    :mod:`lightning_mics.plan.models`; ``instance``: a key of :data:`INSTANCES` (sets GPUs per node, memory and
    bandwidths unless given); other keywords: :class:`Settings`."""
    st = Settings.of(instance, **settings)
    spec = resolve(model, shard_units)
    estimates = [estimate(spec, st, s) for s in degrees_to_plan(st, degrees)]
    recommended = choose(estimates)
    return Plan(spec, st, estimates, recommended, _tensor_parallel_notes(spec, st))
