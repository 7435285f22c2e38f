"""The service's lattice rescorer and lattice preparation, without HTTP (service/model.py, service/frontend/work.py):
the rescorer's tables outlive a batch without changing an answer under any weights, and a request's lattice is
prepared once on its way through the expansion."""

from __future__ import annotations

import math

import pytest
from conftest import TEST_DATA

from smallstate_lm.rescoring.expand.rescorer import build_rescorer
from smallstate_lm.rescoring.formats.lattice_io import lattice_to_text, read_fst
from smallstate_lm.rescoring.lattices.lattice import Lattice, SymbolTable
from smallstate_lm.service.errors import Unavailable
from smallstate_lm.service.frontend.inputs import parse_lattice
from smallstate_lm.service.frontend.work import prepared
from smallstate_lm.service.model import Models
from smallstate_lm.service.schemas import LatticeIn
from smallstate_lm.service.settings import Settings
from smallstate_lm.weights import Weights

LAT_DIR = TEST_DATA / "lattices"
WEIGHTS = {"default": Weights(), "other": Weights(lm_weight=0.3, ngram_weight=1.2, word_penalty=0.7)}


@pytest.fixture(scope="module")
def models(tiny_lm_dir, kenlm_model) -> Models:
    m = Models(Settings(lm=str(tiny_lm_dir), ngram=str(kenlm_model), device="cpu", threads=1))
    m.load()
    return m


def _lattices() -> list[Lattice]:
    symbols = SymbolTable.read(LAT_DIR / "words.txt")
    return [prepared(read_fst(p, symbols)) for p in sorted(LAT_DIR.glob("*.lat.fst"))[:3]]


class _Told:
    """An `inputs.Early` that records what it is told, and refuses (`refuse(seconds)`) when given."""

    def __init__(self, refuse=None):
        self.told, self.floors, self.refuse = [], [], refuse

    def lists(self, seconds: float) -> None:
        self.told.append(seconds)
        if self.refuse is not None:
            self.refuse(seconds)

    def so_far(self, seconds: float) -> None:
        self.floors.append(seconds)


class _Busy(_Told):
    """Refuses the request once its floor passes `slice_s`, as the service does while its worker is busy."""

    def __init__(self, slice_s: float):
        super().__init__()
        self.slice_s = slice_s

    def so_far(self, seconds: float) -> None:
        super().so_far(seconds)
        if seconds > self.slice_s:
            raise Unavailable(f"at least {seconds} s")


class _CountingKenLM:
    """KenLM's model, counting the questions the rescorer asks it."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def BaseScore(self, *args):
        self.calls += 1
        return self.model.BaseScore(*args)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_batches_under_other_weights_share_the_tables_and_get_a_fresh_rescorers_answers(models, monkeypatch):
    lats = _lattices()
    arcs = sum(lat.num_arcs for lat in lats)
    kenlm = _CountingKenLM(models.ngram.model)
    monkeypatch.setattr(models.ngram, "model", kenlm)
    fresh, asked = {}, {}
    for name, w in WEIGHTS.items():  # a rescorer per batch, as the service had
        r = build_rescorer(w, models.loaded, models.ngram, models.expand_config, models.device)
        before = kenlm.calls
        fresh[name] = {i: exp.nbest(w, 5) for i, exp in r.expand_many(lats)}
        asked[name] = kenlm.calls - before
    models.forget_rescorer()
    first = models.rescorer(Weights(), arcs)
    assert {i: exp.nbest(Weights(), 5) for i, exp in first.expand_many(lats)} == fresh["default"]
    before = kenlm.calls
    # then two batches of different weights taking turns on the worker, step by step
    runs = {name: models.rescorer(WEIGHTS[name], arcs).expand_many(lats, pause=True) for name in ("other", "default")}
    got: dict = {name: {} for name in runs}
    while runs:
        for name, steps in list(runs.items()):
            out = next(steps, StopIteration)
            if out is StopIteration:
                del runs[name]
            elif out is not None:
                got[name][out[0]] = out[1].nbest(WEIGHTS[name], 5)
    assert got == fresh
    # the default weights' answers were all known; the other weights' pruning reaches a few pairs more
    assert kenlm.calls - before < asked["other"] / 4, (kenlm.calls - before, asked)

def test_a_request_lattice_is_prepared_once(models, monkeypatch):
    lat = read_fst(LAT_DIR / "slt-dev0004.lat.fst", SymbolTable.read(LAT_DIR / "words.txt"))
    words = dict(line.split() for line in (LAT_DIR / "words.txt").read_text().splitlines() if line.strip())
    body = LatticeIn(format="openfst-text", data=lattice_to_text(lat), words={w: int(i) for w, i in words.items()})
    prepare, names = Lattice.prepare, []
    monkeypatch.setattr(Lattice, "prepare", lambda self: names.append(self.name) or prepare(self))
    parsed = parse_lattice(body, "utterances[0].lattice", "u0", 100_000)
    [(_, exp)] = list(models.rescorer(Weights(), parsed.num_arcs).expand_many([parsed]))
    assert exp.nbest(Weights(), 1) and names == ["u0"]


def test_lists_are_refused_before_they_are_built_with_the_prediction_make_work_makes(models, monkeypatch):
    """A request's hypothesis lists are checked against its deadline from its words alone (before thousands of
    hypotheses are built, the work of a request refused anyway), with what `make_work` predicts for them."""
    import random

    from smallstate_lm.service.errors import CostLimitError
    from smallstate_lm.service.frontend import inputs
    from smallstate_lm.service.frontend.inputs import rescore_work
    from smallstate_lm.service.schemas import RescoreRequest

    words = models.loaded.vocab.words[4:200]
    rng = random.Random(3)
    utterances = [{"id": f"u{i}", "context": "in the beginning" if i % 2 else None,
                   "hypotheses": [{"words": [rng.choice(words) for _ in range(rng.randint(1, 12))],
                                   "am_score": -1.0, "graph_score": -1.0} for _ in range(rng.randint(1, 40))]}
                  for i in range(12)]
    body = RescoreRequest.model_validate({"utterances": utterances})
    early = _Told()
    work = rescore_work(body, models, models.s, early)
    told = early.told
    assert told == [pytest.approx(work.seconds - work.lattice_seconds, rel=1e-12)] and told[0] > 0

    def refuse(seconds):
        raise CostLimitError(f"{seconds} s", "utterances", 1.0)

    built = []
    build = inputs._hypotheses
    monkeypatch.setattr(inputs, "_hypotheses", lambda *a: built.append(a[1]) or build(*a))
    with pytest.raises(CostLimitError, match=f"^{told[0]} s$"):
        rescore_work(body, models, models.s, _Told(refuse))
    assert not built, "no hypothesis was built for a request refused by its prediction"
    rescore_work(body, models, models.s, _Told())
    assert len(built) == len(utterances)


def test_the_floor_told_as_a_request_grows_never_passes_its_prediction(models):
    """While the worker is busy, a request is refused as soon as a floor of its prediction passes one slice;
    the floor (tokens and longest hypothesis per list, no trie) must never pass what `make_work` predicts,
    or a request the full check lets in would be refused: short and deep lists, shared prefixes or none,
    with context, lists scored whole and in pieces."""
    import random

    from smallstate_lm.service.frontend.inputs import rescore_work
    from smallstate_lm.service.schemas import RescoreRequest

    words = models.loaded.vocab.words[4:300]
    rng = random.Random(5)
    for trial in range(40):
        few = rng.choice([2, 14, 200])  # how many distinct words: 2 and 14 share most prefixes

        def hypothesis(few: int = few) -> dict:
            return {"words": [rng.choice(words[:few]) for _ in range(rng.randint(1, rng.choice([8, 60])))],
                    "am_score": -1.0}

        utterances = [{"id": f"u{i}", "context": rng.choice([None, "and god said"]),
                       "hypotheses": [hypothesis() for _ in range(rng.choice([1, 5, 50, 300]))]}
                      for i in range(rng.randint(1, 4))]
        body = RescoreRequest.model_validate({"utterances": utterances})
        early = _Told()
        work = rescore_work(body, models, models.s, early)
        assert len(early.floors) == len(utterances) and early.floors == sorted(early.floors)
        assert 0 < early.floors[-1] <= work.seconds * (1 + 1e-9), (trial, early.floors[-1], work.seconds)


def test_a_busy_service_refuses_a_growing_request_before_the_rest_of_it_is_read(models, monkeypatch):
    """Lists: refused at the first list whose floor passes a slice, before any trie is sized or hypothesis
    built; lattices: refused at the first lattice that passes it, the rest never parsed (a bad one among
    them included: the service could not look at it)."""
    import random

    from smallstate_lm.service.frontend import inputs
    from smallstate_lm.service.schemas import RescoreRequest

    words = models.loaded.vocab.words[4:100]
    rng = random.Random(7)
    lists = [{"id": f"u{i}", "hypotheses": [{"words": [rng.choice(words) for _ in range(30)], "am_score": -1.0}
                                            for _ in range(200)]} for i in range(6)]
    body = RescoreRequest.model_validate({"utterances": lists})
    floors = _Told()
    inputs.rescore_work(body, models, models.s, floors)
    built = []
    build = inputs._hypotheses
    monkeypatch.setattr(inputs, "_hypotheses", lambda *a: built.append(a[1]) or build(*a))
    busy = _Busy(slice_s=(floors.floors[1] + floors.floors[2]) / 2)  # passed at the third list
    with pytest.raises(Unavailable):
        inputs.rescore_work(body, models, models.s, busy)
    assert busy.floors == floors.floors[:3] and not busy.told and not built

    lat = _lattices()[0]
    rows = [line.split("\t") for line in lattice_to_text(lat).splitlines()]
    text = "\n".join("\t".join(r[:2] + [lat.symbols.word(int(r[2]))] * 2 + r[4:]) if len(r) == 5 else "\t".join(r)
                     for r in rows) + "\n"
    lattices = [{"id": f"u{i}", "lattice": {"format": "openfst-text", "data": text}} for i in range(3)]
    lattices.append({"id": "bad", "lattice": {"format": "openfst-text", "data": "0 1 x\n"}})
    body = RescoreRequest.model_validate({"utterances": lattices})
    parsed = []
    parse = inputs.parse_lattice
    monkeypatch.setattr(inputs, "parse_lattice", lambda *a, **k: parsed.append(a[1]) or parse(*a, **k))
    one = _Told()
    # not busy: every lattice is read, the bad one named
    with pytest.raises(inputs.ServiceError, match=r"^utterances\[3\]\.lattice"):
        inputs.rescore_work(body, models, models.s, one)
    parsed.clear()
    with pytest.raises(Unavailable):
        inputs.rescore_work(body, models, models.s, _Busy(slice_s=1.5 * one.floors[0]))
    assert parsed == ["utterances[0].lattice", "utterances[1].lattice"]


def test_lattices_stop_being_parsed_once_their_predicted_seconds_pass_the_limit(models, monkeypatch):
    import dataclasses

    from smallstate_lm.service.cost import lattice_shape
    from smallstate_lm.service.errors import CostLimitError
    from smallstate_lm.service.frontend import inputs
    from smallstate_lm.service.schemas import RescoreRequest

    lat = _lattices()[0]
    one = models.cost.lattice(lattice_shape(lat, models.s.max_per_state), models.expand_config.max_level_bytes,
                              True, True).seconds
    rows = [line.split("\t") for line in lattice_to_text(lat).splitlines()]  # words as labels, as a client sends
    text = "\n".join("\t".join(r[:2] + [lat.symbols.word(int(r[2]))] * 2 + r[4:]) if len(r) == 5 else "\t".join(r)
                     for r in rows) + "\n"
    body = RescoreRequest.model_validate({"utterances": [
        {"id": f"u{i}", "lattice": {"format": "openfst-text", "data": text}} for i in range(6)]})
    parsed = []
    parse = inputs.parse_lattice
    monkeypatch.setattr(inputs, "parse_lattice", lambda *a, **k: parsed.append(a[1]) or parse(*a, **k))
    limit = dataclasses.replace(models.s, max_request_seconds=2.5 * one)
    with pytest.raises(CostLimitError) as e:
        inputs.rescore_work(body, models, limit)
    assert e.value.field == "utterances[2].lattice" and "max_request_seconds" in str(e.value)
    assert parsed == [f"utterances[{i}].lattice" for i in range(3)], "the last three were never parsed"
    inputs.rescore_work(body, models, dataclasses.replace(models.s, max_request_seconds=6.5 * one))


def test_lattices_that_do_not_fit_together_are_expanded_fewer_at_a_time_and_one_over_the_limit_is_refused(
        models, monkeypatch):
    """Lattices expanded together hold their LM states together: where the largest of a request's lattices would
    need more than max_request_bytes together, the work plans fewer at a time (the request is let in, its peak
    within the limit); a lattice over the limit alone is refused naming it, the lattices after it never read."""
    import dataclasses

    from smallstate_lm.service.cost import lattices_together
    from smallstate_lm.service.errors import CostLimitError
    from smallstate_lm.service.frontend import inputs
    from smallstate_lm.service.schemas import RescoreRequest

    lat = _lattices()[0]
    rows = [line.split("\t") for line in lattice_to_text(lat).splitlines()]
    text = "\n".join("\t".join(r[:2] + [lat.symbols.word(int(r[2]))] * 2 + r[4:]) if len(r) == 5 else "\t".join(r)
                     for r in rows) + "\n"
    body = RescoreRequest.model_validate({"utterances": [
        {"id": f"u{i}", "lattice": {"format": "openfst-text", "data": text}} for i in range(6)]})
    one = inputs.rescore_work(RescoreRequest.model_validate({"utterances": body.utterances[:1]}), models,
                              models.s).nbytes
    assert one > 0
    limit = dataclasses.replace(models.s, max_request_bytes=int(2.5 * one))
    work = inputs.rescore_work(body, models, limit)
    assert work.nbytes == 2 * one <= limit.max_request_bytes
    per_batch, peaks = models.expand_config.lattices_per_batch(True), [it.nbytes for it in work.items]
    assert lattices_together(per_batch, peaks, limit.max_request_bytes) == 2
    assert lattices_together(per_batch, peaks, 100 * one) == 6  # all fit: one batch
    parsed = []
    parse = inputs.parse_lattice
    monkeypatch.setattr(inputs, "parse_lattice", lambda *a, **k: parsed.append(a[1]) or parse(*a, **k))
    small = dataclasses.replace(models.s, max_request_bytes=one - 1)
    with pytest.raises(CostLimitError) as e:
        inputs.rescore_work(body, models, small)
    assert e.value.field == "utterances[0].lattice" and "max_request_bytes" in str(e.value)
    assert parsed == ["utterances[0].lattice"], "the other lattices were never parsed"


def test_the_worker_expands_a_group_of_lattices_as_many_at_a_time_as_fit_the_byte_limit(models, monkeypatch):
    """Two requests under the same weights share one expansion: the worker runs it with as many lattices in flight
    as fit max_request_bytes together (the server's setting), and both requests get their answers."""
    import dataclasses

    from smallstate_lm.rescoring.expand import rescorer as lattice_expand
    from smallstate_lm.service.engine.batcher import Job
    from smallstate_lm.service.engine.worker import EngineWork, Worker
    from smallstate_lm.service.frontend import inputs
    from smallstate_lm.service.frontend.submit import engine_submit
    from smallstate_lm.service.schemas import RescoreRequest

    lat = _lattices()[0]
    rows = [line.split("\t") for line in lattice_to_text(lat).splitlines()]
    text = "\n".join("\t".join(r[:2] + [lat.symbols.word(int(r[2]))] * 2 + r[4:]) if len(r) == 5 else "\t".join(r)
                     for r in rows) + "\n"
    bodies = [RescoreRequest.model_validate({"utterances": [
        {"id": f"r{k}u{i}", "lattice": {"format": "openfst-text", "data": text}} for i in range(3)]}) for k in (0, 1)]
    one = inputs.rescore_work(RescoreRequest.model_validate({"utterances": bodies[0].utterances[:1]}), models,
                              models.s).nbytes
    monkeypatch.setattr(models, "s", dataclasses.replace(models.s, max_request_bytes=int(2.5 * one)))
    works = [inputs.rescore_work(b, models, models.s) for b in bodies]
    flights: list[int] = []  # the lattices in flight at each level of the expansion
    fill = lattice_expand._Schedule._fill

    def counted(self, step):
        fill(self, step)
        flights.append(len(self.active))

    monkeypatch.setattr(lattice_expand._Schedule, "_fill", counted)
    answers = {}
    jobs = [Job(w.cost, EngineWork(engine_submit(models, w, math.inf, math.inf))) for w in works]
    for _ in Worker(models).run_batch(jobs, lambda job, res: answers.update({id(job): res})):
        pass
    assert len(answers) == 2 and not any(isinstance(r, BaseException) for r in answers.values()), answers
    assert max(flights) == 2, flights  # six lattices, two at a time
