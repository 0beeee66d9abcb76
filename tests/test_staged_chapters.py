"""CI runs the shared GPU's branches on the CPU: every chapter job of ``course.py test --gpu``
(:data:`minipar.course.gpu_run.GPU_TESTS`), a representative part of its quick tier, with
``MINIPAR_TRANSPORT=gloo-staged``.

A GPU is at hand only now and then; ranks sharing one (Colab, Kaggle) talk over Gloo through a
host copy out and back of every message, a path CPU ranks never took, and the first GPU run found
it broken in most chapters. Launched with ``transport="gloo-staged"`` CPU ranks take that path:
the same copies (plain buffers instead of pinned ones), the same ``staging`` events and labels.
The whole quick tier in that mode costs as much as the suite itself, so each test file of a job
contributes the tests named in :data:`STAGED`: the strategy's equivalence with one process on
its small configurations, and the checks that read the trace (counts, bytes, labels), which the
staging events would disturb; a file left out says why. A new file in a job fails
:func:`test_every_file_of_every_gpu_job_has_a_staged_selection` until it is given one.
All the selected tests run in one pytest process (one interpreter and one pool of ranks).
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from minipar.course import gpu_run
from minipar.runtime.backend import gpu_count

ROOT = Path(__file__).resolve().parents[1]

# test file -> (its tests run staged: node ids after "file::", or () and why not)
STAGED = {
    "tests/test_comm.py": (["test_collectives_match_torch_and_bytes_match_the_model",
                            "test_recorded_bytes_come_from_the_tensors_so_a_wrong_formula_fails",
                            "test_collectives_work_on_subgroups"],
                           "every native collective and the ring's point-to-point calls, staged; bytes from the trace"),
    "tests/test_data_parallel.py": (["test_overlap_starts_all_reduce_during_backward",
                                     "test_wrap_broadcasts_from_rank_0_and_keeps_names",
                                     "test_mixed_precision_follows_the_reference"],
                                    "bucketed all-reduce overlapping backward, the broadcast, bf16 (the 20 s "
                                    "equivalence over every version stays unstaged)"),
    "tests/test_data_parallel_async.py": (["test_parameter_server"], "Gloo's any-source receive beside staged sends"),
    "tests/test_model_parallel.py": (["test_gpt_three_way_split_matches_single_process"],
                                     "the naive split's activations and gradients sent staged"),
    "tests/test_pipeline_equivalence.py": (["test_zb_h1_with_tensor_parallelism"],
                                           "a pipeline with the stage label on every message, and TP inside it"),
    "tests/test_adaptive.py": (["test_repartition_keeps_training_and_moves_layers"],
                               "layers and optimizer state moved point to point"),
    "tests/test_tensor_parallel.py": (["test_run_trains_like_one_device", "test_bytes_per_layer_match_formula"],
                                      "f and g staged, and the bytes per layer read from the trace"),
    "tests/test_zero.py": (["test_stage3_gathers_and_frees", "test_mixed_precision"],
                           "stage 3's gathers and reduce-scatters, bf16"),
    "tests/test_zero_per_parameter.py": (["test_per_parameter_trains_like_one_process[2]"],
                                         "3 collectives per unit, staged or not"),
    "tests/test_zero_persist.py": ((), "stage 3's own collectives run staged in test_zero and per parameter"),
    "tests/test_zero_options.py": (["test_fully_shard_reduces_in_its_own_dtype"], "the reduce dtype through staging"),
    "tests/test_hybrid.py": ((), "its layouts (a 17 s fixture) are covered by the mesh tests below"),
    "tests/test_mesh5d.py": (["test_5d_dp_cp_pp_ep", "test_zero_stages_1_to_3_on_a_dp_tp_mesh"],
                             "every dimension at once, each group staged"),
    "tests/test_zero_mesh.py": (["test_zero2_and_zero3_under_a_pipeline", "test_hsdp_2x2_zero3"],
                                "ZeRO under a pipeline, HSDP"),
    "tests/test_plan_zero3_pp.py": (["test_a_searched_hsdp_layout_runs_at_toy_size"], "a planner layout trained"),
    "tests/test_context_parallel.py": (["test_training_matches_one_process[cp2-ring-zigzag]",
                                        "test_training_matches_one_process[cp4-all_gather]",
                                        "test_training_matches_one_process[cp4-ulysses]",
                                        "test_cp_on_the_hybrid_mesh_matches_one_process[cp2xpp2xtp2]"],
                                       "ring, all-gather and Ulysses attention; CP with a pipeline and TP"),
    "tests/test_attention.py": ((), "one process: no message to stage"),
    "tests/test_expert_parallel.py": (["test_ep_tp_training_matches_single_process",
                                       "test_all_to_all_bytes_are_elements_times_their_size",
                                       "test_bf16_autocast_trains_close_to_fp32"],
                                      "all-to-all with uneven splits staged, EP x TP, bf16"),
    "tests/test_plan.py": ((), "its one launch (chapter 07's memory, 30 s) measures memory, not messages; "
                               "the formulas need no rank"),
    "tests/test_recompute.py": (["test_tensor_and_pipeline_parallel", "test_other_strategies_with_recompute"],
                                "recomputation under TP and a pipeline, messages staged"),
    "tests/test_precision.py": (["test_fp16_is_float16_and_trains_like_one_process_in_fp16"],
                                "fp16 messages staged (bf16 runs staged in the data-parallel, ZeRO and EP "
                                "selections; every strategy in bf16 takes 40 s)"),
    "tests/test_adapt.py": (["test_training_command_switches_twice_and_resumes_past_a_switch"],
                            "the training command's switches: holdings resharded by one staged all-to-all"),
    "tests/test_elastic.py": ((), "torchrun's elastic agents: its one test is in the slow tier"),
    "tests/test_train.py": (["test_bf16_with_recomputation_trains_like_one_process_in_bf16"],
                            "the training command in bf16 (the 34 s resume across meshes stays unstaged)"),
    "tests/test_train_options.py": (["test_zero2_and_zero3_layouts_through_the_command_train_like_one_process",
                                     "test_moe_5d_run_resumes_on_another_layout_like_one_process"],
                                    "ZeRO and a 5D MoE layout through the command, resumed"),
    "tests/test_checkpoint.py": (["test_resume_same_mesh_is_exact_and_other_meshes_match"],
                                 "sharded checkpoints gathered and scattered over staged messages"),
    "tests/test_faults.py": (["test_a_nan_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint",
                              "test_the_watchdog_stops_every_rank_of_a_launch_with_one_report"],
                             "one verdict per step agreed over staged messages; the hang report"),
    "tests/test_devices.py": ((), "its staging test chooses both transports by name; the meta-device step "
                                  "of every strategy (22 s) moves no real message"),
    "tests/test_launch.py": (["test_results_in_rank_order_with_trace", "test_raising_rank_is_reported_and_next_launch_works"],
                             "launching staged ranks: results, traces, a failing rank"),
    "tests/test_gpu_paths.py": ((), "fakes of NCCL and CUDA"),
    "tests/test_staged_labels.py": ((), "chooses both transports by name"),
    "tests/test_staged_mode.py": ((), "chooses both transports by name"),
    "tests/test_placement_sites.py": ((), "reads the source: no rank"),
    "tests/test_zero_spans.py": ((), "the shards' bookkeeping; stage 3's collectives run staged in test_zero"),
    "tests/test_zero_prefetch.py": (["test_a_prefetched_gather_is_waited_for_at_its_units_use_not_when_started"],
                                    "the order of a rank's events, with host copies among them"),
    "tests/test_zero_mesh_units.py": ((), "the mesh's ZeRO-3 and HSDP run staged in test_zero_mesh"),
    "tests/test_pipeline_tags.py": ((), "tags are the same on every transport; a staged pipeline runs in "
                                        "test_pipeline_equivalence"),
    "tests/test_straggler_costs.py": ((), "one all-reduce of fixed readings"),
    "tests/test_adapt_layouts.py": ((), "its switches move state by the all-to-all test_adapt runs staged"),
    "tests/test_stepping.py": ((), "the executor it steps is the pipeline's, staged in test_pipeline_equivalence"),
    "tests/test_ranks_magic.py": ((), "a notebook kernel's ranks, placed as launch places them (test_launch runs staged)"),
    "tests/test_reference.py": (["test_a_tensor_parallel_model_on_a_subgroup"],
                                "the reference of a model that holds a process group, f and g staged"),
    "tests/test_gpu_run.py": ((), "the GPU run's own bookkeeping: no rank trains"),
}


def _selection() -> list[str]:
    """The node ids of every selected test."""
    return [f"{f}::{t}" for f, (tests, _) in STAGED.items() if (ROOT / f).exists() for t in tests]


@pytest.fixture(scope="module")
def staged_results(tmp_path_factory):
    """Runs the selection once, staged, in a fresh pytest: ``{file: {test: outcome}}``."""
    xml = tmp_path_factory.mktemp("staged") / "report.xml"
    env = dict(os.environ, MINIPAR_TRANSPORT="gloo-staged", MINIPAR_DEVICE="cpu")
    env.pop("PYTEST_ADDOPTS", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                        f"--junitxml={xml}", *_selection()], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    out: dict = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        f = "tests/" + case.get("classname").rsplit(".", 1)[-1] + ".py"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        out.setdefault(f, {})[case.get("name")] = "passed" if bad is None else (
            "skipped" if case.find("skipped") is not None else bad.get("message", "failed")[:300])
    out["_log"] = p.stdout[-3000:]
    return out


def test_every_file_of_every_gpu_job_has_a_staged_selection():
    in_jobs = {f for _, files in gpu_run.GPU_TESTS for f in files if (ROOT / f).exists()}
    missing = sorted(in_jobs - set(STAGED))
    assert missing == [], f"give these files a staged selection (or a reason) in STAGED: {missing}"
    assert all(why for _, why in STAGED.values())
    assert all((ROOT / n.split("::")[0]).exists() for n in _selection())


@pytest.mark.slow
@pytest.mark.skipif(gpu_count() > 0, reason="on a GPU machine course.py test --gpu runs the jobs themselves")
@pytest.mark.parametrize("job", [name for name, _ in gpu_run.GPU_TESTS])
def test_the_jobs_quick_tier_passes_with_its_messages_staged(staged_results, job):
    files = [f for name, fs in gpu_run.GPU_TESTS if name == job for f in fs if f in STAGED and STAGED[f][0]]
    ran = {f: staged_results.get(f, {}) for f in files}
    if not files:
        pytest.skip(f"{job}: " + "; ".join(STAGED[f][1] for name, fs in gpu_run.GPU_TESTS if name == job
                                            for f in fs if f in STAGED))
    assert all(ran.values()), f"{job}: nothing ran for {[f for f, r in ran.items() if not r]}\n{staged_results['_log']}"
    failed = {f"{f}::{t}": why for f, r in ran.items() for t, why in r.items() if why not in ("passed", "skipped")}
    assert failed == {}, f"{job}, staged: {failed}"

