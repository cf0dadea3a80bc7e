"""Plant known bugs one at a time in a copy of the repository and check that the tests catch
each: the audit of what the suite proves (docs/testing.md, "Planted bugs").

    python tools/plant_bugs.py                 # every bug; a table of bug -> catching tests
    python tools/plant_bugs.py --only offload-early-gather comm-split-settings
    python tools/plant_bugs.py --list          # the bugs, their files and tests
    python tools/plant_bugs.py --clean         # first run every listed test unplanted

Each bug is a file, text found there exactly once, its replacement, and the pytest node ids
that must fail with it. For each, the repository (with Numba's caches, so that only the
changed module compiles again) is copied to a temporary directory, the text replaced, and
the node ids run there with ``python -m pytest``; the bug counts as caught when every listed
test fails. The copies are removed afterwards (``--keep`` leaves them). Nothing here changes
the repository itself. When the code moves (an engine refactor), a bug whose text is no longer
found is reported as such: update its text, file or tests.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    name: str
    what: str                         # the bug, in words
    edits: tuple                      # ((file, old text, new text), ...)
    tests: tuple                      # pytest node ids that must fail


def bug(name, what, tests, *edits):
    return Bug(name, what, tuple(edits), tuple(tests))


BUGS = [
    bug("offload-early-gather", "partial offload: a bucket whose shard the cut splits starts its "
        "all-gather when its device part is done, before its host part is copied back",
        ["tests/test_offload.py::test_offloaded_equals_not_offloaded[3-None]"],
        ("zero1_mpi/state/placement.py",
         "        return [part.bucket.index] if part.b == part.bucket.shard_size else []",
         "        return [part.bucket.index]")),
    bug("offload-host-segments", "offload: the host part's 8-bit state quantizes the small "
        "tensors' pieces too (their segments lose the flag)",
        ["tests/test_offload.py::test_offloaded_equals_not_offloaded[3-None]"],
        ("zero1_mpi/state/placement.py",
         "        host_segments = [(a - cut, b - cut, q) for a, b, q in segments if a >= cut]",
         "        host_segments = [(a - cut, b - cut, True) for a, b, q in segments if a >= cut]")),
    bug("comm-split-settings", "comm: Communicator.split drops the explicit persistent/"
        "cuda_aware/device_started/stage_host settings",
        ["tests/test_comm.py::test_split_keeps_the_explicit_settings",
         "tests/test_hierarchical.py::test_hierarchical_sharding_then_checkpoints_at_other_"
         "sizes[4-2-3]"],
        ("zero1_mpi/comm/communicator.py",
         "                cuda_aware=self.cuda_aware,\n                persistent=self.persistent,\n"
         "                device_started=self.device_started,\n"
         "                stage_host=self.stage_host,\n",
         "")),
    bug("step-overflow-local", "step: an inf/nan sum of squares is not agreed: no rank "
        "skips the step",
        ["tests/test_bad_input.py::test_bad_input_raises_on_every_rank[3]"],
        ("zero1_mpi/step/pipeline.py", "            sum_sq=sum_sq,\n",
         "            sum_sq=sum_sq if math.isfinite(sum_sq) else 0.0,\n")),
    bug("step-grad-norm-sum", "step: the reported norm (and clipping) of the sum over "
        "ranks, not of the mean",
        ["tests/test_parity.py::test_n_ranks_equal_one_process[3-numpy-sub_cases2]"],
        ("zero1_mpi/step/pipeline.py",
         "return math.sqrt(agreed.sum_sq) / (self.comm.size * self.counters.scaler.scale)",
         "return math.sqrt(agreed.sum_sq) / self.counters.scaler.scale")),
    bug("state-lamb-local-norm", "state: a two-phase rule's tensor sums (LAMB's norms) are "
        "not summed over the ranks",
        ["tests/test_parity.py::test_n_ranks_equal_one_process[3-numpy-sub_cases2]"],
        ("zero1_mpi/state/sharded.py",
         "            totals = self.topology.shard_comm.allreduce_sum(totals)\n", "")),
    bug("step-options-differ", "step: group options that differ between ranks are not "
        "refused",
        ["tests/test_bad_input.py::test_bad_input_raises_on_every_rank[3]"],
        ("zero1_mpi/step/pipeline.py",
         "        if not Agreement.same(agreed.options, agreed.options_sq, ranks):",
         "        if False:")),
    bug("ledger-shard-fp32", "ledger: memory_report books a 16-bit gradient shard "
        "(stage 2) as fp32",
        ["tests/test_memory.py::test_allocations_measured_with_tracemalloc_follow_the_"
         "formula[3]"],
        ("zero1_mpi/memory/ledger.py",
         "\"gradients\": (owned if gradients.sharded else psi) * grads.dtype.itemsize,",
         "\"gradients\": owned * 4 if gradients.sharded else psi * grads.dtype.itemsize,")),
    bug("checkpoint-prune-follows-links", "checkpoint: the clean-up after a save follows "
        "links (a linked .tmp-* or archived ckpt-* loses its files)",
        ["tests/test_checkpoint_cleanup.py::test_saves_remove_only_their_own_files[links]"],
        ("zero1_mpi/persistence/publish.py", "if e.is_dir(follow_symlinks=False)]",
         "if e.is_dir()]"),
        ("zero1_mpi/persistence/publish.py", "os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW",
         "os.O_RDONLY | os.O_DIRECTORY"),
        ("zero1_mpi/persistence/publish.py", "e.is_file(follow_symlinks=False)", "e.is_file()")),
    bug("checkpoint-failed-save-stays", "checkpoint: a save that failed leaves its .tmp-* "
        "directory (and its space) behind",
        ["tests/test_checkpoint_cleanup.py::test_saves_remove_only_their_own_files[failures]",
         "tests/test_checkpoint_cleanup.py::test_after_a_full_disk_the_next_save_that_fits_"
         "succeeds"],
        ("zero1_mpi/persistence/checkpoint.py", "            remove_tree(tmp)\n", "            pass\n")),
    bug("persistence-publish-while-writing", "persistence: a non-blocking save is published by "
        "the next step although a rank is still writing",
        ["tests/test_async_save.py::test_non_blocking_saves[3-None]"],
        ("zero1_mpi/persistence/on_disk.py",
         "if pending is not None and not pending.done and not agreed.writing:",
         "if pending is not None and not pending.done:")),
    bug("binding-drops-keywords", "binding: the pass-through drops keyword arguments "
        "(save(blocking=False) blocks)",
        ["tests/test_bindings.py::test_a_forwarded_call_reaches_the_core"],
        ("zero1_mpi/bindings/common.py", "return getattr(self.sharded, name)(*args, **kwargs)",
         "return getattr(self.sharded, name)(*args)")),
    bug("buckets-early-start", "buckets: a bucket's reduction starts before its last tensor "
        "is ready",
        ["tests/test_buckets.py::test_overlapped_communication_gives_the_same_bits",
         "tests/test_buckets.py::test_buckets_start_last_to_first_once_their_tensors_are_"
         "ready"],
        ("zero1_mpi/gradients/stage1.py",
         "while self._next_start >= 0 and self._waiting[self._next_start] <= 0:",
         "while self._next_start >= 0 and self._waiting[self._next_start] <= 1:")),
    bug("grad-shards-overwrite", "grad_shards (stage 2): each micro-batch's sum replaces the "
        "shard instead of adding to it",
        ["tests/test_stage2.py::test_stage2_equals_stage1_and_the_reference_on_n_ranks[3]"],
        ("zero1_mpi/gradients/stage2.py", "            if first:\n"
         "                shard[...] = block\n            else:",
         "            if True:\n                shard[...] = block\n            else:")),
    bug("grad-shards-twice-silent", "grad_shards (stage 2): a gradient handed over twice is "
        "not reported",
        ["tests/test_stage2.py::test_stage2_equals_stage1_and_the_reference_on_n_ranks[1]"],
        ("zero1_mpi/gradients/stage2.py",
         "                self.problem = self.problem or (\n"
         "                    f\"the gradient of {name!r} was handed over twice",
         "                self.problem = self.problem and (\n"
         "                    f\"the gradient of {name!r} was handed over twice")),
    bug("checkpoint-column", "checkpoint: a load ignores where a saved range starts in its "
        "file",
        ["tests/test_checkpoint.py::test_every_rules_checkpoints_load_on_other_world_sizes"],
        ("zero1_mpi/persistence/checkpoint.py",
         "columns = slice(column + start - lo, column + stop - lo)",
         "columns = slice(start - lo, stop - lo)")),
    bug("export-counters", "export: load_consolidated restores no step count, loss scaler "
        "or options",
        ["tests/test_checkpoint.py::test_every_rules_checkpoints_load_on_other_world_sizes"],
        ("zero1_mpi/persistence/consolidated.py", "        counters.restore(*saved)\n", "")),
    bug("layout-fingerprint-dtype", "layout: the fingerprint ignores the dtype",
        ["tests/test_layout.py::test_fingerprint_changes_with_anything_that_must_agree"],
        ("zero1_mpi/flat/layout.py", "                self.align,\n                self.dtype,\n",
         "                self.align,\n")),
    bug("lion-twins-beta", "rules/lion.py, both twins: the interpolation uses beta2 (the twins "
        "agree with each other)",
        ["tests/test_rule_kernels.py::test_numpy_twin_follows_the_float64_reference"
         "[lion-0-float32]",
         "tests/test_parity.py::test_n_ranks_equal_one_process[3-numpy-sub_cases2]"],
        ("zero1_mpi/rules/lion.py", "np.multiply(m, s.beta1, out=t)",
         "np.multiply(m, s.beta2, out=t)"),
        ("zero1_mpi/rules/lion.py", "c = m * beta1 + g * omb1", "c = m * beta2 + g * omb1")),
    bug("lion-numba-twin", "rules/lion.py, the Numba twin only: the moment's update uses "
        "1 - beta1",
        ["tests/test_rule_kernels.py::test_numba_twin_is_bitwise_the_numpy_twin"
         "[lion-0-float32]"],
        ("zero1_mpi/rules/lion.py", "neg_lr, m * beta2 + g * omb2",
         "neg_lr, m * beta2 + g * omb1")),
    bug("adam-bias-correction", "rules/adam.py: the second moment's bias correction uses "
        "beta1",
        ["tests/test_rule_kernels.py::test_adam_step_scalars_follow_torch",
         "tests/test_rule_kernels.py::test_numpy_twin_follows_the_float64_reference"
         "[adam-1-float32]"],
        ("zero1_mpi/rules/adam.py", "bc2_sqrt=math.sqrt(1.0 - beta2**step),",
         "bc2_sqrt=math.sqrt(1.0 - beta1**step),")),
    bug("sgd-group-momentum", "rules/sgd.py: momentum asked by a param group alone gets no "
        "buffer",
        ["tests/test_bad_input.py::test_bad_input_raises_on_every_rank[1]"],
        ("zero1_mpi/rules/sgd.py",
         "values = [momentum] + [g.get(\"momentum\", 0) for g in groups if isinstance(g, dict)]",
         "values = [momentum]")),
    bug("watchdog-no-bucket", "watchdog: the message does not name the bucket",
        ["tests/test_watchdog.py::test_fires_once_armed_too_long_and_never_when_disarmed_in_"
         "time"],
        ("zero1_mpi/comm/watchdog.py",
         "where = \"\" if self.bucket is None else f\" of bucket {self.bucket}\"",
         "where = \"\"")),
    bug("preemption-handlers", "preemption: close() installs the default handlers, not the "
        "previous ones",
        ["tests/test_preemption.py::test_overflow_and_bad_arguments"],
        ("zero1_mpi/persistence/preemption.py",
         "signal.signal(sig, handler if handler is not None else signal.SIG_DFL)",
         "signal.signal(sig, signal.SIG_DFL)")),
    bug("torch-no-sync", "torch binding: no_sync() lets each backward start the reductions",
        ["tests/test_torch_adapter.py::test_adapter_matches_torch_adamw_with_schedulers_on_n_"
         "ranks[3]"],
        ("zero1_mpi/torch.py", "previous, self._sync = self._sync, False",
         "previous, self._sync = self._sync, True")),
    bug("wire-truncates", "the 8-bit encoder (NumPy) truncates instead of rounding to nearest",
        ["tests/test_wire.py::test_encode_equals_the_float64_model[False-900-float32-numpy]"],
        ("zero1_mpi/wire/codec.py", "            np.rint(w, out=w)\n", "            np.trunc(w, out=w)\n")),
    bug("wire-misses-inf", "the 8-bit encoder (Numba) does not mark a block holding inf or nan",
        ["tests/test_wire.py::test_encode_equals_the_float64_model[False-900-float32-numba]"],
        ("zero1_mpi/wire/codec.py", "    if top >= np.int32(0x7F800000):  # inf or nan",
         "    if top > np.int32(0x7FFFFFFF):  # inf or nan")),
    bug("wire-feedback-lost", "error feedback: the residual is never added nor kept",
        ["tests/test_wire.py::test_the_8bit_paths_on_n_ranks[2-parts0]"],
        ("zero1_mpi/wire/gradient_exchange.py", "        self.codec.encode(values, packed, residual)",
         "        self.codec.encode(values, packed, None)")),
    bug("wire-gather-owner-exact", "8-bit gathers: the owner keeps its exact new shard instead of "
        "adding the decoded change as every other rank does (the copies differ)",
        ["tests/test_wire.py::test_the_8bit_paths_on_n_ranks[2-parts0]"],
        ("zero1_mpi/wire/param_gathers.py", "        self._codec.decode_add(mine, self._params[lo:hi])",
         "        self._params[lo:hi] = self._new[:n]")),
    bug("wire-gather-padding", "8-bit gathers: the change over the padding, which LAMB's "
        "kernel leaves unwritten, is sent (the copies' padding and block scales take stale "
        "values)",
        ["tests/test_wire.py::test_the_8bit_paths_on_n_ranks[2-parts0]"],
        ("zero1_mpi/wire/param_gathers.py", "        change[real:] = 0", "")),
    bug("wire-across-order", "8-bit sum across 3 shard groups: the replicas' parts summed in "
        "reverse order (the same bits everywhere, but not the format's rank order)",
        ["tests/test_wire.py::test_the_8bit_paths_on_n_ranks[6-parts3]"],
        ("zero1_mpi/wire/gradient_exchange.py", "        codec.decode_sum(received.reshape(r, row), hi - lo, mine)",
         "        codec.decode_sum(received.reshape(r, row)[::-1], hi - lo, mine)")),
    bug("remainder-ties-forgotten", "remainder masters: a tie (half a bf16 step above an even "
        "parameter) is not kept, so it comes back half a step below",
        ["tests/test_masters.py::test_masters_come_back_bit_for_bit_and_equal_the_model[numpy]",
         "tests/test_masters.py::test_bitwise_today_on_other_world_sizes[1]"],
        ("zero1_mpi/state/masters.py", "        if lo < hi or ties.size:\n",
         "        if False:\n")),
    bug("remainder-stale-param", "remainder masters: the parameter changes after its "
        "remainder is kept, so the pair no longer makes the master",
        ["tests/test_masters.py::test_bitwise_today_on_other_world_sizes[2]"],
        ("zero1_mpi/state/sharded.py", "            self.masters.store(st, master, param)\n",
         "            self.masters.store(st, master, param)\n"
         "            param[:1] = param[:1] * 2\n")),
    bug("generated-tie-below", "generated Numba pass: a remainder master's old tie is decoded "
        "half a bf16 step below instead of above",
        ["tests/test_generated_kernels.py::test_the_generated_pass_is_the_numpy_twin_bit_for_bit"
         "[bfloat16-remainder-float32]"],
        ("zero1_mpi/kernels/numba_scalars.py", "np.uint32(np.uint32(tie) * np.uint32(2 * TIE))",
         "np.uint32(0)")),
    bug("generated-int8-map", "generated Numba pass: an 8-bit block's codes decoded with the "
        "unsigned map whatever its scale's sign",
        ["tests/test_generated_kernels.py::test_the_generated_pass_is_the_numpy_twin_bit_for_bit"
         "[bfloat16-remainder-int8]"],
        ("zero1_mpi/kernels/numba_generated.py",
         "map{k} = SIGNED if np.signbit(q{k}) else UNSIGNED", "map{k} = UNSIGNED")),
    bug("int8-encoder-no-step", "Numba 8-bit encoder: a value's code is its top half's first "
        "code, without the step past the next bound",
        ["tests/test_state_dtypes.py::test_8bit_state_equals_its_float64_model[numba]"],
        ("zero1_mpi/state/int8_blocks.py", "out[i] = code + (past[code] < x)", "out[i] = code")),
    bug("generated-new-ties-lost",
        "generated Numba pass: the new ties are counted but not flagged, so none is kept",
        ["tests/test_generated_kernels.py::test_the_generated_pass_is_the_numpy_twin_bit_for_bit"
         "[bfloat16-remainder-float32]"],
        ("zero1_mpi/kernels/numba_generated.py", "flags[i] = r == TIE", "flags[i] = False")),
    bug("generated-sr-same-bits", "generated Numba pass: bf16 state rounds every element with "
        "the range's first element's bits",
        ["tests/test_generated_kernels.py::test_the_generated_pass_is_the_numpy_twin_bit_for_bit"
         "[bfloat16-fp32-bfloat16]"],
        ("zero1_mpi/kernels/numba_generated.py", "stream_at(seed{k}, a + i)",
         "stream_at(seed{k}, a)")),
    bug("sr-ignores-step", "bf16 state: the stochastic rounding draws the same bits every step",
        ["tests/test_state_dtypes.py::test_rounding_is_unbiased_and_draws_by_index_step_and_array"
         "[numba]"],
        ("zero1_mpi/state/encodings.py", "        return (flat * _INDEX + step * _STEP + ",
         "        return (flat * _INDEX + 0 * _STEP + ")),
    bug("int8-one-map", "8-bit state: every block takes the signed map (the unsigned one's "
        "finer codes are lost for the second moment)",
        ["tests/test_state_dtypes.py::test_8bit_state_equals_its_float64_model[numpy]"],
        ("zero1_mpi/state/int8_blocks.py",
         "    signed = (bits > np.uint32(0x80000000)).any(axis=1)\n",
         "    signed = (bits >= np.uint32(0)).any(axis=1)\n")),
    bug("generated-cuda-old-ties", "generated CuPy pass: a remainder of -TIE is decoded half a "
        "step below its parameter even where the range's ties list it (above)",
        ["tests/test_cuda_generated.py::test_the_generated_cuda_pass_is_the_numpy_twin_bit_for_bit"
         "[bfloat16-remainder-float32]"],
        ("zero1_mpi/kernels/cuda_generated.py", "ties[z_lo] == {at}) z_bits += 0x10000u;",
         "ties[z_lo] == {at}) z_bits += 0u;")),
    bug("generated-cuda-new-ties-lost", "generated CuPy pass: a new tie is flagged but not "
        "counted, so it is never read back",
        ["tests/test_cuda_generated.py::test_the_generated_cuda_pass_is_the_numpy_twin_bit_for_bit"
         "[bfloat16-remainder-bfloat16]"],
        ("zero1_mpi/kernels/cuda_generated.py", "        atomicAdd(&tie_count[0], 1);\n", "")),
    bug("generated-cuda-int8-sign", "generated CuPy pass: an 8-bit block with a negative value "
        "keeps a positive scale (decoded with the unsigned map)",
        ["tests/test_cuda_generated.py::test_the_generated_cuda_pass_is_the_numpy_twin_bit_for_bit"
         "[bfloat16-fp32-int8]"],
        ("zero1_mpi/kernels/cuda_generated.py", "(up{i} ? amax{i} : -amax{i})", "(amax{i})")),
    bug("generated-cuda-sr-same-bits", "generated CuPy pass: bf16 state rounds every element "
        "with the range's first element's bits",
        ["tests/test_cuda_generated.py::test_the_generated_cuda_pass_is_the_numpy_twin_bit_for_bit"
         "[float32-fp32-bfloat16]"],
        ("zero1_mpi/kernels/cuda_generated.py", "(unsigned int)({at}) * 0x9E3779B1u",
         "(unsigned int)(0) * 0x9E3779B1u")),
    bug("int8-numba-scale-sign", "8-bit state (Numba): the signed map's blocks keep a positive "
        "scale, so they decode with the unsigned map",
        ["tests/test_state_dtypes.py::test_8bit_state_twins_agree"],
        ("zero1_mpi/state/int8_blocks.py", "(amax if up else -amax)", "(amax if up else amax)")),
    bug("state-not-stored", "two-phase rules: the state their first phase updates is not kept "
        "(LAMB's moments stay at their start with bf16 or 8-bit state)",
        ["tests/test_state_dtypes.py::test_every_rule_against_its_model_on_n_ranks[3]"],
        ("zero1_mpi/state/sharded.py", "                self._stored(bucket, a, b, None, None, call[2:-1])",
         "                pass")),
]

#: Not copied: the repository's history and what builds or runs leave behind (but Numba's
#: caches in __pycache__, which the copy keeps so that only a changed module compiles again).
IGNORE = shutil.ignore_patterns(".git", "build", "*.egg-info", ".pytest_cache")


def copy_with(bug_: Bug | None, where: Path) -> Path:
    """A copy of the repository under ``where`` with ``bug_`` planted (None: unplanted)."""
    root = where / (bug_.name if bug_ else "clean")
    shutil.copytree(ROOT, root, ignore=IGNORE, symlinks=True)
    for file, old, new in bug_.edits if bug_ else ():
        path = root / file
        text = path.read_text()
        if text.count(old) != 1:
            raise LookupError(f"{bug_.name}: {file} holds its text {text.count(old)} times, "
                              f"not once: update the bug for the code as it is now\n{old}")
        path.write_text(text.replace(old, new))
    return root


def run_tests(root: Path, tests, timeout: float) -> tuple[set, str, float]:
    """``(the node ids that failed or errored, the output, seconds)`` of pytest in ``root``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                             "-rfE", "--rootdir", str(root), *tests], cwd=root, env=env,
                            capture_output=True, text=True, timeout=timeout)
    out = result.stdout + result.stderr
    failed = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.MULTILINE))
    return failed, out, time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these bugs only")
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    parser.add_argument("--clean", action="store_true",
                        help="first run every listed test on an unplanted copy: all must pass")
    parser.add_argument("--keep", action="store_true", help="keep the copies")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per bug")
    args = parser.parse_args(argv)
    bugs = [b for b in BUGS if not args.only or b.name in args.only]
    unknown = set(args.only or ()) - {b.name for b in BUGS}
    if unknown:
        parser.error(f"unknown bugs {sorted(unknown)}; known: {', '.join(b.name for b in BUGS)}")
    if args.list:
        for b in bugs:
            files = sorted({file for file, _, _ in b.edits})
            print(f"{b.name}: {b.what} ({', '.join(files)})\n    " + "\n    ".join(b.tests))
        return 0
    where = Path(tempfile.mkdtemp(prefix="plant-"))
    missed = 0
    try:
        if args.clean:
            tests = sorted({t for b in bugs for t in b.tests})
            failed, out, seconds = run_tests(copy_with(None, where), tests, args.timeout * 3)
            if failed or "passed" not in out:
                print(out)
                print(f"unplanted, these fail already: {sorted(failed)}")
                return 1
            print(f"unplanted: the {len(tests)} tests pass ({seconds:.0f} s)")
        print("| bug | module | caught by | s |\n|---|---|---|---:|")
        for b in bugs:
            try:
                root = copy_with(b, where)
            except LookupError as exc:
                print(f"| {b.name} | NOT PLANTED: {exc} | | |")
                missed += 1
                continue
            failed, out, seconds = run_tests(root, b.tests, args.timeout)
            caught = [t for t in b.tests if t in failed]
            files = ", ".join(sorted({file for file, _, _ in b.edits}))
            if len(caught) == len(b.tests):
                print(f"| {b.name}: {b.what} | {files} | {'; '.join(caught)} | {seconds:.0f} |",
                      flush=True)
            else:
                missed += 1
                print(f"| {b.name}: {b.what} | {files} | MISSED by "
                      f"{'; '.join(sorted(set(b.tests) - failed))} | {seconds:.0f} |", flush=True)
                print(out[-3000:], file=sys.stderr)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(where, ignore_errors=True)
    print(f"{len(bugs) - missed} of {len(bugs)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
