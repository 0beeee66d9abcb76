"""Hybrid (2D/3D) parallelism: data × pipeline × tensor parallelism on a process mesh,
with ZeRO-1 over the data-parallel dimension as an option (Narayanan et al. 2021).

The API (every function below is importable from ``minipar.hybrid``)::

    # driver, before launch: plain errors for a configuration that cannot work
    check_config(config, dp, pp, tp, world_size=None, microbatches=1, batch_size=None,
                 schedule="1f1b", virtual_stages=1, sequence_parallel=False) -> None
    choose_config(config, world_size, batch_size, microbatches=1, memory_per_rank=None,
                  ranks_per_node=8, zero1=False) -> {"dp", "pp", "tp"}
    valid_configs(config, world_size, batch_size=None, microbatches=1) -> [{"dp", "pp", "tp"}, ...]

    # inside every rank
    mesh = ProcessMesh(dp=2, pp=2, tp=2)                     # from minipar.mesh
    model = build(config, mesh, seed=0, zero1=False, schedule="1f1b", microbatches=2,
                  virtual_stages=1, sequence_parallel=False,
                  optimizer_cls=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})  # -> HybridModel
    loss = model.train_step(x, y)       # global batch on every rank -> global mean loss (float)
    model.optimizer                     # torch optimizer, or ZeroOptimizer (.optim inside)
    model.full_state_dict()             # single-device GPT names, full tensors (collective)
    model.load_full_state_dict(sd)      # each rank takes its stages' tp shards
    model.local_state_dict()            # this rank's shards, single-device names
    model.coords, model.mesh, model.groups, model.stages, model.memory(), model.last_step

    # the whole run, measured (tests, notebook 07)
    run(config, batches, dp, pp, tp, seed=0, **build_kwargs) -> launch results
    compare(config, batches, world_size=8) -> (rows, results)  # every strategy side by side

Every global batch is cut into ``dp`` shards (:func:`minipar.data.shard`) and each shard
into ``microbatches``; the loss returned is the single-process loss of the global batch.
``mesh_coordinates`` and ``group_members`` (exercise 07) are re-exported from
:mod:`minipar.mesh`.
"""
from ..cost import hybrid_comm_bytes, hybrid_memory_per_rank
from ..mesh import ProcessMesh, group_members, mesh_coordinates
from .config import check_config, choose_config, num_layers, num_params, valid_configs
from .model import HybridModel, build
from .train import run, train
from .compare import compare, strategies  # noqa: E402 - needs the model

__all__ = ["ProcessMesh", "mesh_coordinates", "group_members", "check_config", "choose_config",
           "valid_configs", "num_layers", "num_params", "HybridModel", "build", "train", "run",
           "hybrid_comm_bytes", "hybrid_memory_per_rank", "compare", "strategies"]
