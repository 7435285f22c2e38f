"""Lattice rescoring on Ray: one local Ray instance for the module; the distributed run
must write what the local run writes, report bad files the same way, and surface a
worker's loading error as the user-facing error it is."""

import json
import math
import socket

import numpy as np
import pytest
from conftest import TEST_DATA, run_cli

pytest.importorskip("ray.data")

from smallstate_lm.checkpoint import load_model  # noqa: E402
from smallstate_lm.errors import CheckpointError  # noqa: E402
from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer  # noqa: E402
from smallstate_lm.rescoring.formats.lattice_io import read_fst  # noqa: E402
from smallstate_lm.rescoring.lattices.lattice import SymbolTable  # noqa: E402
from smallstate_lm.rescoring.nbest.lists import read_text  # noqa: E402
from smallstate_lm.rescoring.runs.jobs import RescoreJob  # noqa: E402
from smallstate_lm.rescoring.runs.lattice_files import rescore_lattice_files  # noqa: E402
from smallstate_lm.rescoring.runs.ray_runner import RayCluster, rescore_lattice_files_ray  # noqa: E402
from smallstate_lm.weights import Weights  # noqa: E402

# Starting Ray, its actors and the CLI subprocesses takes seconds each; a stuck cluster
# must fail the test, not hang the suite.
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings(r"ignore::DeprecationWarning:ray\.data\.context")]

LAT_DIR = TEST_DATA / "lattices"
WORDS = LAT_DIR / "words.txt"
W = Weights(am_scale=0.105, lm_weight=0.5, ngram_weight=0.5)


@pytest.fixture(scope="module")
def ray_address():
    import ray

    ctx = ray.init(num_cpus=2, include_dashboard=False, logging_level="error", object_store_memory=100 * 2**20)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


def _lattices():
    return sorted(LAT_DIR.glob("*.lat.fst"))


def _local_run(out, tiny_lm_dir, kenlm_model, paths, on_error=None):
    lm = load_model(tiny_lm_dir)
    rescorer = LatticeRescorer(W, lm.model, lm.vocab, NgramLM(kenlm_model), ExpandConfig())
    return rescore_lattice_files(paths, SymbolTable.read(WORDS), rescorer, out, read_text(LAT_DIR / "ref.txt"),
                                 progress=False, on_error=on_error)


def _job(tiny_lm_dir, kenlm_model):
    return RescoreJob(str(WORDS.resolve()), str(tiny_lm_dir.resolve()), str(kenlm_model.resolve()), W, ExpandConfig())


def _files(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _nbest(out):
    return [json.loads(line) for line in (out / "nbest.jsonl").read_text().splitlines()]


def assert_same_outputs(a, b, same_batches: bool = True):
    """The two runs wrote the same files: texts equal, scores equal up to float rounding
    (batched sums differ in the last bit with the batch's composition). Runs whose lattices
    went through the LM in other batches may also differ where that rounding flips a near-tie:
    in pruning (a rescored lattice's arcs) or in ranking (hypotheses of totals within TIE)."""
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    if "wer.txt" in fa and same_batches:
        assert fa["wer.txt"] == fb["wer.txt"]
    na = {u["utt"]: u["hyps"] for u in _nbest(a)} if "nbest.jsonl" in fa else {}
    nb = {u["utt"]: u["hyps"] for u in _nbest(b)} if "nbest.jsonl" in fb else {}
    assert na.keys() == nb.keys()
    for utt, ha in na.items():
        hb = nb[utt]
        if same_batches:
            assert [h["words"] for h in ha] == [h["words"] for h in hb], utt
        else:  # ranks agree in their totals; a swap only between hypotheses that tie
            assert np.allclose([h["total"] for h in ha], [h["total"] for h in hb], rtol=1e-6, atol=TIE), utt
        by_words = {tuple(h["words"]): h for h in hb}
        for h in ha:
            other = by_words.get(tuple(h["words"]))
            if other is not None or same_batches:
                for key in ("am", "graph", "neural", "ngram", "total"):
                    assert math.isclose(h[key], other[key], rel_tol=1e-6, abs_tol=1e-5), (utt, key)
    if same_batches:
        assert fa["best.txt"] == fb["best.txt"]
    symbols = SymbolTable.read(WORDS)
    compared = 0
    for name in (n for n in fa if n.endswith(".lat.fst")):
        la, lb = read_fst(a / name, symbols), read_fst(b / name, symbols)
        same = (la.num_states, la.start) == (lb.num_states, lb.start) and all(
            np.array_equal(getattr(la, key), getattr(lb, key)) for key in ("src", "dst", "word"))
        assert same or not same_batches, name
        if same:
            compared += 1
            for key in ("graph", "acoustic", "final_graph", "final_acoustic"):
                assert np.allclose(getattr(la, key), getattr(lb, key), rtol=1e-5, atol=1e-4), (name, key)
    assert compared, "no rescored lattice kept its arcs in both runs"


TIE = 1e-4  # nats: totals this close may swap ranks when float rounding differs


def test_ray_run_writes_the_local_runs_files(tmp_path, ray_address, tiny_lm_dir, kenlm_model):
    paths = _lattices()
    local = _local_run(tmp_path / "local", tiny_lm_dir, kenlm_model, paths)
    dist = rescore_lattice_files_ray(paths, _job(tiny_lm_dir, kenlm_model), tmp_path / "ray",
                                     read_text(LAT_DIR / "ref.txt"), progress=False)
    local_files = _files(tmp_path / "local")
    assert {"best.txt", "nbest.jsonl", "wer.txt"} <= set(local_files)
    assert len([f for f in local_files if f.startswith("lattices/")]) == len(paths)
    assert_same_outputs(tmp_path / "local", tmp_path / "ray")
    assert (dist.lattices, dist.arcs, dist.expanded_states, dist.lm_calls, dist.wer) == \
           (local.lattices, local.arcs, local.expanded_states, local.lm_calls, local.wer)


def test_other_batches_on_two_actors_agree_up_to_float_rounding(tmp_path, ray_address, tiny_lm_dir, kenlm_model):
    paths = _lattices()
    _local_run(tmp_path / "local", tiny_lm_dir, kenlm_model, paths)
    rescore_lattice_files_ray(paths, _job(tiny_lm_dir, kenlm_model), tmp_path / "ray", read_text(LAT_DIR / "ref.txt"),
                              cluster=RayCluster(max_actors=2, batch_size=1), progress=False)
    assert_same_outputs(tmp_path / "local", tmp_path / "ray", same_batches=False)


def test_cli_with_ray_skips_a_bad_file_like_the_local_run(tmp_path, ray_address, tiny_lm_dir, kenlm_model):
    broken = tmp_path / "broken.lat.fst"
    broken.write_bytes(_lattices()[0].read_bytes()[:100])
    args = [*_lattices()[:2], broken, "--words", WORDS, "--lm", tiny_lm_dir, "--ngram", kenlm_model,
            "--set", "am_scale=0.105", "--quiet"]
    local = run_cli("rescore", *args, "-o", tmp_path / "local", timeout=120)
    dist = run_cli("rescore", *args, "-o", tmp_path / "ray", "--ray", ray_address, "--ray-actors", "1", timeout=180)
    assert local.returncode == dist.returncode == 2, dist.stderr
    errors = [line for line in local.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "broken.lat.fst" in errors[0]
    assert errors[0] in dist.stderr.splitlines() and "Traceback" not in dist.stderr
    assert dist.stdout.splitlines()[-1].startswith("2 lattices,")
    assert_same_outputs(tmp_path / "local", tmp_path / "ray")


def test_a_worker_that_cannot_load_the_lm_raises_the_users_error(tmp_path, ray_address, kenlm_model):
    bad = tmp_path / "bad_lm"
    bad.mkdir()
    (bad / "model.pt").write_bytes(b"not a checkpoint")
    job = RescoreJob(str(WORDS.resolve()), str(bad), str(kenlm_model.resolve()), W, ExpandConfig())
    with pytest.raises(CheckpointError, match="bad_lm"):
        rescore_lattice_files_ray(_lattices()[:1], job, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_address_nothing_answers_on_fails_at_once(tmp_path, kenlm_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free again once closed: nothing listens there
    proc = run_cli("rescore", _lattices()[0], "--words", WORDS, "--ngram", kenlm_model, "-o", tmp_path / "out",
                   "--ray", f"127.0.0.1:{port}", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --ray 127.0.0.1:{port}: no Ray cluster")
    assert not (tmp_path / "out").exists()


def test_documents_in_spoken_order_on_two_actors_write_what_the_local_run_writes(tmp_path, ray_address, tiny_lm_dir,
                                                                                  kenlm_model):
    from smallstate_lm.rescoring.runs.context_run import ContextPlan

    paths = _lattices()
    utt2doc = tmp_path / "utt2doc"
    # two documents, each spoken in the reverse of the files' order
    utt2doc.write_text("".join(f"{p.name.split('.')[0]} {p.name[:3]}\n" for p in reversed(paths)))
    plan = ContextPlan.read(utt2doc, 1)
    lm = load_model(tiny_lm_dir)
    rescorer = LatticeRescorer(W, lm.model, lm.vocab, NgramLM(kenlm_model), ExpandConfig())
    rescore_lattice_files(paths, SymbolTable.read(WORDS), rescorer, tmp_path / "local", read_text(LAT_DIR / "ref.txt"),
                          progress=False, context=plan)
    job = RescoreJob(str(WORDS.resolve()), str(tiny_lm_dir.resolve()), str(kenlm_model.resolve()), W, ExpandConfig(),
                     context=plan)
    rescore_lattice_files_ray(paths, job, tmp_path / "ray", read_text(LAT_DIR / "ref.txt"),
                              cluster=RayCluster(max_actors=2), progress=False)
    assert_same_outputs(tmp_path / "local", tmp_path / "ray", same_batches=False)
    assert (tmp_path / "local" / "best.txt").read_text() == (tmp_path / "ray" / "best.txt").read_text()
