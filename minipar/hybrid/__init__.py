"""Hybrid parallelism: data × context × pipeline × tensor × expert parallelism on one process
mesh, with ZeRO over the data-parallel dimension as an option (Narayanan et al. 2021).

The API, in the shape of every strategy (:mod:`minipar.strategy`), all from ``minipar.hybrid``::

    # driver, before launch: plain errors for a configuration that cannot work
    check(model, batches, world_size, dp=1, pp=1, tp=1, microbatches=1, ...)  # model: GPT or GPTConfig
    run(model, batches, world_size, optimizer=None, dp=2, pp=2, tp=2, **options) -> TrainResult  # dp·pp·tp·cp
    choose_config(config, world_size, batch_size, memory_per_rank=None, ...) -> {"dp", "pp", "tp"}
    valid_configs(config, world_size, batch_size=None, microbatches=1) -> [{"dp", "pp", "tp"}, ...]

    # inside every rank
    train(model, batches, optimizer=None, dp=, pp=, tp=, **options) -> {"losses", "params", "measured"}
    hm = build(model, ProcessMesh(dp=2, pp=2, tp=2), zero=1, microbatches=2, ...)  # a HybridModel
    loss = hm.train_step(x, y)          # global batch on every rank -> global mean loss (float)
    hm.step(x, y), hm.loss_groups       # the step body and the loss record's groups (minipar.strategy.loop)
    hm.optimizer, hm.full_state_dict(), hm.load_full_state_dict(sd), hm.local_state_dict(),
    hm.coords, hm.mesh, hm.groups, hm.stages, hm.memory(), hm.last_step   # see HybridModel

Every global batch is cut into ``dp`` shards (:func:`minipar.data.shard`) and each shard into
``microbatches``; the loss returned is the single-process loss of the global batch. Context
parallelism is a fourth dimension: ``cp=`` (with ``variant="ring"|"all_gather"|"ulysses"`` and
``layout="zigzag"|"contiguous"``, :mod:`minipar.context_parallel`) splits every sequence over the
cp ranks, and gradients are averaged over the combined dp × cp group. Expert parallelism: ``ep=``
spreads a mixture-of-experts GPT's experts over ep groups carved out of dp × cp, capacity and the
auxiliary loss counted per micro-batch (:mod:`.experts` defines the reference it equals). ZeRO:
``zero=1`` everywhere, ``zero=2|3`` (``sharding="flat"|"per-parameter"``) on dense layers with
any dp, cp, tp and pp, sharded over dp·cp; under a pipeline stage 3 keeps a stage's layers
gathered across its micro-batches (``reshard_after_forward="auto"|"always"|"never"``, :mod:`.sharding`). ``mesh_coordinates`` and
``group_members`` (exercise 07) are re-exported from :mod:`minipar.mesh`. Every strategy side by side
(``compare``) and a planner's layout at toy size (``toy_run``) are studies of this package,
in :mod:`minipar.study`."""
from ..cost import hybrid_comm_bytes, hybrid_memory_per_rank
from ..mesh import ProcessMesh, group_members, mesh_coordinates
from .config import check, choose_config, num_layers, num_params, valid_configs
from .model import HybridModel, build
from .train import run, train
from . import experts

__all__ = ["ProcessMesh", "mesh_coordinates", "group_members", "check", "choose_config",
           "valid_configs", "num_layers", "num_params", "HybridModel", "build", "train", "run",
           "hybrid_comm_bytes", "hybrid_memory_per_rank", "experts"]
