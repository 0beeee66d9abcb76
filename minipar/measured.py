"""What a rank measured in a strategy's last step: one typed record, :class:`Measured`, with the
same fields for every strategy (``seconds``, ``bytes_by_dim``, ``memory``) and ``extras`` under the
names of :data:`EXTRAS` only. :func:`minipar.strategy.loop` makes it; a strategy's ``train`` fills
its ``memory`` and extras; :class:`minipar.strategy.TrainResult` holds one per rank.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field

EXTRAS = {
    # the loop's, on request, and the driver's
    "events": "the last step's trace events (loop(events=True); the mesh strategies)",
    "step_seconds": "every step's seconds, in order (loop(history=True))",
    "gpu_peak_bytes": "the caching allocator's peak over the run on a GPU (on_device)",
    # the parameter server (minipar.data_parallel.parameter_server)
    "eval_losses": "the server's loss on the held-out batch after every update",
    "times": "seconds since the start at every update, on the server",
    "staleness": "τ = t - v of every applied gradient",
    "workers": "the worker of every applied update (0: all, synchronous)",
    "dropped": "gradients dropped as staler than max_staleness",
    "updates": "updates the server applied",
    "gradients": "gradients a worker computed",
    # pipeline parallelism
    "peak_stash": "micro-batches held at once at the peak of the last step",
    "bounds_before": "the pipeline's layer cut before re-partitioning (probe_steps)",
    "bounds_after": "the cut after re-partitioning by the layers' measured times",
    "layer_times": "every layer's measured seconds, from which the new cut comes",
    "events_before": "the last probing step's trace events, on the first cut",
    "events_after": "the last step's trace events, on the new cut",
    # ZeRO and the mesh's sharding
    "unit_sizes": "the elements of every sharded unit, as the formulas take them",
    "persistent": "elements stage 3 keeps whole (persist_below=, persist=)",
    "grad_norm": "the last step's global gradient norm before clipping (max_grad_norm=)",
    "peak_gathered_bytes": "the most bytes of ZeRO-3's gathered units alive at once",
    "peak_held_grad_bytes": "the most bytes of ZeRO-3's unreduced gradients held at once",
    "peak_state_bytes": "the most bytes of ZeRO-3's parameters, gradients and optimizer state held at once",
    # context parallelism
    "bytes_by_name": "the last step's bytes sent by operation name",
    "attention_seconds": "the last step's attention seconds, forward and backward",
    # expert parallelism
    "tokens_per_expert": "tokens each expert received, [step][layer][expert]",
    "kept_matrix": "the last step's tokens kept, [layer][source][expert], this ep group",
    "local_experts": "the experts this rank holds, per MoE layer",
    "parameters": "this rank's parameter count (experts sharded)",
    # the mesh and adapting parallelism
    "coords": "this rank's coordinates on the mesh",
    "switches": "this rank's record of every layout switch",
    "decisions": "the log of the candidates probed and the one chosen",
    "repartitions": "the log of the pipeline's re-partitions",
    "layout": "the layout trained last",
    "bounds": "the pipeline's cut trained last",
}
"""Every name a :class:`Measured` record's ``extras`` may take, with its meaning: an entry beyond
the fields is one of these, not an ad hoc key."""


@dataclass
class Measured(MutableMapping):
    """What a rank measured in the last step, with the same fields for every strategy:

    * ``seconds``: the step body's wall time (:func:`minipar.strategy.loop`);
    * ``bytes_by_dim``: the bytes this rank sent by mesh dimension, with ``"total"``
      (``bytes_sent``, a property, is the total);
    * ``memory``: this rank's bytes of model states, ``{"params", "grads", "optimizer", ...}``
      (plus ``"activations"`` and ``"total"`` where the strategy counts them);
    * ``extras``: what a strategy measures beyond them, each under a name of :data:`EXTRAS`.

    It reads and writes like a dict too: ``m["memory"]``, ``m["bytes_sent"]``, an extra by its name
    (``m["tokens_per_expert"]``); setting a name that is not a field goes into ``extras``."""

    seconds: float = 0.0
    bytes_by_dim: dict = field(default_factory=lambda: {"total": 0})
    memory: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)

    FIELDS = ("seconds", "bytes_by_dim", "memory")

    def __post_init__(self):
        for name in self.extras:
            self._known(name)

    @staticmethod
    def _known(name):
        if name not in EXTRAS:
            raise KeyError(f"{name!r} is not a field of Measured nor a name of strategy.EXTRAS")

    @property
    def bytes_sent(self) -> int:
        return self.bytes_by_dim.get("total", 0)

    def __getitem__(self, key):
        if key in self.FIELDS or key == "bytes_sent":
            return getattr(self, key)
        return self.extras[key]

    def __setitem__(self, key, value):
        if key in self.FIELDS:
            setattr(self, key, value)
        else:
            self._known(key)
            self.extras[key] = value

    def __delitem__(self, key):
        del self.extras[key]

    def __iter__(self):
        yield from ("seconds", "bytes_sent", "bytes_by_dim", "memory", *self.extras)

    def __len__(self):
        return 4 + len(self.extras)
