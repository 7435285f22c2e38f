"""Request and response schemas (pydantic v2); they are the OpenAPI document at /docs.

All scores are natural logarithms (ln), higher is better. Limits that are settings
(utterances, hypotheses, words, lattice arcs, nbest) are checked by the service after
parsing and answered with 422 naming the field and the limit.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# Scores and weights are bounded so that no finite combination of them overflows.
MAX_ABS_SCORE = 1e9
MAX_ABS_WEIGHT = 1e4
MAX_WORD_CHARS = 1000  # one word, whether given in `words` or inside a text


# Exactly the characters of str.isspace(), which str.split() uses, as a class the validator's own (Rust) regex
# engine checks: a per-word Python check was 40% of parsing a large hypothesis list.
SPACES = "\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NO_SPACE = f"^[^{SPACES}]+$"


def _words(s: str) -> str:
    """Whitespace-separated words, each capped like an item of `words`."""
    longest = max(map(len, s.split()), default=0)
    if longest > MAX_WORD_CHARS:
        raise ValueError(f"a word may have at most {MAX_WORD_CHARS} characters (as in 'words'); one here has "
                         f"{longest}")
    return s


# Strings hold valid Unicode only: the JSON parser refuses lone surrogates (KenLM and the response could not
# encode them), and a body it refuses is checked as a whole (http/bodies.py, `_parse`).
Text = str
Words = Annotated[str, AfterValidator(_words)]
# OpenAPI shows the readable \S (its regex dialect has no exact spelling of str.isspace).
Word = Annotated[str, Field(min_length=1, max_length=MAX_WORD_CHARS, pattern=NO_SPACE,
                            json_schema_extra={"pattern": r"^\S+$"},
                            description=f"One word: no whitespace, at most {MAX_WORD_CHARS} characters.")]
Id = Annotated[str, Field(min_length=1, max_length=256)]
Score = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_ABS_SCORE, le=MAX_ABS_SCORE)]
WeightValue = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_ABS_WEIGHT, le=MAX_ABS_WEIGHT)]


def _exactly_one(*fields: tuple[str, str]) -> dict:
    """JSON Schema for "exactly one of these fields is given and not null" (what the validators check)."""
    return {"oneOf": [{"required": [name], "properties": {name: {"type": kind}}} for name, kind in fields]}


class _Strict(BaseModel):
    # No coercion ("1" is not a number, "true" not a boolean) and no unknown fields (a typo is an error).
    model_config = ConfigDict(extra="forbid", strict=True)


class HypothesisIn(_Strict):
    """One first-pass hypothesis: `text` (split on whitespace) or `words`, exactly one."""

    model_config = ConfigDict(json_schema_extra=_exactly_one(("text", "string"), ("words", "array")))

    id: Optional[Id] = Field(None, description="Echoed back; default: the hypothesis's position in the list.")
    text: Optional[Words] = Field(None, description=f"The words, separated by whitespace; each at most "
                                  f"{MAX_WORD_CHARS} characters.")
    words: Optional[list[Word]] = Field(None, description="The words as a list (no whitespace inside a word).")
    am_score: Score = Field(..., description="Acoustic log-likelihood, natural log (higher is better).")
    graph_score: Score = Field(0.0, description="First-pass LM / graph log-probability, natural log.")

    @model_validator(mode="after")
    def _one_of(self) -> "HypothesisIn":
        if (self.text is None) == (self.words is None):
            raise ValueError("give exactly one of 'text' and 'words'")
        return self


class LatticeIn(_Strict):
    """A first-pass lattice as text. OpenFST text: `src dst ilabel olabel graph,acoustic` arcs and
    `state graph,acoustic` finals (costs are -ln); HTK SLF: `N= L=` header, `I=` nodes, `J= S= E= W= a= l=`
    links (plain text, not gzip)."""

    format: Literal["openfst-text", "htk-slf"]
    data: Text = Field(..., min_length=1, description="The lattice file's text.")
    words: Optional[dict[Word, Annotated[int, Field(ge=0, le=2**31 - 1)]]] = Field(
        None, description="The decoder's symbol table as {word: id}. OpenFST text with integer labels needs it; "
        "without it, labels are the words themselves (id 0 / `<eps>` is epsilon).")


class UtteranceIn(_Strict):
    """An n-best list (`hypotheses`) or a `lattice`, exactly one."""

    model_config = ConfigDict(json_schema_extra=_exactly_one(("hypotheses", "array"), ("lattice", "object")))

    id: Id
    hypotheses: Optional[list[HypothesisIn]] = Field(None, min_length=1, description="An n-best list.")
    lattice: Optional[LatticeIn] = None
    context: Optional[Words | list[Words]] = Field(
        None, description="What was said before this utterance: the previous transcript (words, whitespace-"
        "separated), or a list of previous transcripts, oldest first (at most max_context_utts). The neural LM "
        "reads them, each followed by </s>, before the hypotheses or the lattice (as `rescore --utt2doc` and an LM "
        "trained with --context-sentences do); their own log-probs are not counted; the n-gram starts at <s>. "
        "Not with `session`, which supplies it.")

    @model_validator(mode="after")
    def _one_of(self) -> "UtteranceIn":
        if (self.hypotheses is None) == (self.lattice is None):
            raise ValueError("give exactly one of 'hypotheses' and 'lattice'")
        return self


class WeightsIn(_Strict):
    """Overrides of the server's default weights (see /v1/models). total = am_scale*am + graph_scale*graph
    + lm_weight*neural + ngram_weight*ngram + word_penalty*n_words + oov_penalty*n_oov (loglinear); with
    interpolation=linear the two LM terms become lm_weight * sum_t ln(lam p_neural + (1-lam) p_ngram)."""

    am_scale: Optional[WeightValue] = None
    graph_scale: Optional[WeightValue] = None
    lm_weight: Optional[WeightValue] = None
    ngram_weight: Optional[WeightValue] = None
    word_penalty: Optional[WeightValue] = None
    oov_penalty: Optional[WeightValue] = None
    interpolation: Optional[Literal["loglinear", "linear"]] = None
    lam: Optional[Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]] = None
    mbr_scale: Optional[Annotated[float, Field(ge=0.0, le=MAX_ABS_WEIGHT, allow_inf_nan=False)]] = Field(
        None, description="Hypothesis lists: > 0 ranks by minimum Bayes risk, the fewest expected word errors "
        "under the posterior softmax(mbr_scale * total) over the list; 0 ranks by total. Lattices with "
        "decode=mbr: the sharpness of the consensus's posterior (0: posterior_scale's).")
    posterior_scale: Optional[Annotated[float, Field(gt=0.0, le=MAX_ABS_WEIGHT, allow_inf_nan=False)]] = Field(
        None, description="Lattices: word confidences are posteriors under exp(posterior_scale * total).")
    decode: Optional[Literal["viterbi", "mbr"]] = Field(
        None, description="Lattices: the transcript is the best path (viterbi) or the consensus (mbr: the word "
        "sequence with the fewest expected word errors under the lattice's posterior).")


SessionId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
                                 description="A session's id, chosen by the client (letters, digits, . _ : -).")]


class RescoreRequest(_Strict):
    utterances: list[UtteranceIn] = Field(..., min_length=1)
    session: Optional[SessionId] = Field(
        None, description="A session made with POST /v1/sessions: the request's one utterance is rescored after "
        "the session's last transcripts (its context_utts of them), and its transcript (a list's best hypothesis, "
        "a lattice's transcript) is kept for the next request. Requests of a session are served one after "
        "another, in arrival order.")
    weights: Optional[WeightsIn] = None
    nbest: Optional[int] = Field(None, ge=1, description="Hypotheses returned per utterance: the n best of a list "
                                 "(default: all), the n best distinct word sequences of a lattice (default: the "
                                 "server's lattice_nbest, 1 unless configured: the best only).")
    return_token_logprobs: bool = Field(False, description="Per-token natural-log probabilities (words + </s>) "
                                        "of each LM, for hypothesis lists.")


class TokenLogprobs(BaseModel):
    neural: Optional[list[float]] = None
    ngram: Optional[list[float]] = None


class ScoredHypothesis(BaseModel):
    """Components are natural-log scores before weighting; `penalty` is the weighted
    word_penalty*n_words + oov_penalty*n_oov term; `total` is the weighted sum (higher is better)."""

    id: Optional[str] = None
    words: list[str]
    rank: int = Field(..., description="0 = best under the request's weights.")
    total: float
    am: float
    graph: float
    neural: Optional[float] = Field(None, description="Neural LM ln-probability of words + </s> (null without one).")
    ngram: Optional[float] = Field(None, description="N-gram ln-probability of words + </s> (null without one).")
    penalty: float
    n_words: int
    n_oov: int
    expected_errors: Optional[float] = Field(None, description="Under MBR (mbr_scale > 0): expected word errors "
                                             "of this hypothesis against the list's posterior.")
    confidences: Optional[list[float]] = Field(None, description="A list's best hypothesis: each word's confidence "
                                               "in [0, 1], the probability under softmax(posterior_scale * total) "
                                               "of the hypotheses that say it in its place (lattices: `transcript`).")
    token_logprobs: Optional[TokenLogprobs] = None


class Transcript(BaseModel):
    """A lattice's transcript under the request's `decode`, each word with its confidence: its posterior in
    [0, 1] under exp(posterior_scale * total), in its slot once the lattice is aligned to the transcript."""

    decode: Literal["viterbi", "mbr"]
    words: list[str]
    confidences: list[float]


class UtteranceResult(BaseModel):
    id: str
    source: Literal["hypotheses", "lattice"]
    best: ScoredHypothesis
    hypotheses: list[ScoredHypothesis]
    transcript: Optional[Transcript] = Field(None, description="Lattices only: the best path (decode=viterbi) or "
                                             "the consensus (decode=mbr), with word confidences.")


class Usage(BaseModel):
    utterances: int
    hypotheses: int = Field(..., description="Hypotheses scored (lattices: n-best entries returned).")
    tokens_total: int = Field(..., description="Tokens scored by the neural LM: words + </s> of every hypothesis "
                              "(context included), plus lattice expansion steps.")
    tokens_computed: int = Field(..., description="Of those, the ones computed: unique prefixes per utterance, "
                                 "plus lattice expansion steps.")
    lattice_arcs: int
    batch_requests: int = Field(..., description="Requests merged into the forward passes that served this one.")
    queue_ms: float = Field(..., description="Waiting for the worker, milliseconds.")
    compute_ms: float = Field(..., description="From the batch's start to this response's scores, milliseconds.")


class WeightsOut(BaseModel):
    am_scale: float
    graph_scale: float
    lm_weight: float
    ngram_weight: float
    word_penalty: float
    oov_penalty: float
    interpolation: Literal["loglinear", "linear"]
    lam: float
    mbr_scale: float
    posterior_scale: float
    decode: Literal["viterbi", "mbr"]


class RescoreResponse(BaseModel):
    utterances: list[UtteranceResult]
    weights: WeightsOut = Field(..., description="The weights applied (server defaults plus the request's).")
    usage: Usage


class ScoreRequest(_Strict):
    sentences: list[Words] = Field(..., min_length=1, description="Whitespace-separated words (each at most "
                                   f"{MAX_WORD_CHARS} characters); each sentence is scored from <s> and includes "
                                   "</s>.")
    return_token_logprobs: bool = False


class LMScore(BaseModel):
    logprob: float = Field(..., description="Sum of natural-log probabilities over words + </s>.")
    perplexity: float = Field(..., description="exp(-logprob / tokens).")
    token_logprobs: Optional[list[float]] = None


class SentenceScore(BaseModel):
    words: list[str]
    tokens: int = Field(..., description="Words + </s>.")
    n_oov: int
    neural: Optional[LMScore] = None
    ngram: Optional[LMScore] = None


class ScoreResponse(BaseModel):
    sentences: list[SentenceScore]
    usage: Usage


class NeuralInfo(BaseModel):
    name: str = Field(..., description="The run directory's (or checkpoint file's) name, not its path.")
    preset: str
    parameters: int
    vocab_size: int
    tokenizer: str = Field("word", description="What the LM's tokens are: word, or the SentencePiece model it was "
                           "trained with (e.g. bpe:2000), whose pieces sum to each word's score.")
    state_numel_per_position: int = Field(..., description="Numbers of LM state stored per history position.")
    state_bytes_per_position: int
    config: dict


class NgramInfo(BaseModel):
    name: str = Field(..., description="The n-gram file's name, not its path.")
    order: int


class ModelsResponse(BaseModel):
    neural: Optional[NeuralInfo]
    ngram: Optional[NgramInfo]
    device: str
    precision: Optional[str] = Field(None, description="The neural LM's weights and state: fp32, bf16 or fp16 "
                                     "(log-probs are float32 whatever it is); null without a neural LM.")
    weights: WeightsOut = Field(..., description="Default weights.")
    lattice: dict = Field(..., description="Lattice expansion settings.")
    batching: dict
    cost_model: dict = Field(..., description="The cost model calibrated at warm-up on this server's device "
                             "(seconds per trie node, call and lattice row; bytes of LM state per position), and "
                             "the share of their upper bound that lattices have taken here so far.")


class SessionIn(_Strict):
    id: SessionId
    context_utts: Optional[int] = Field(None, ge=0, description="Previous transcripts each request is read after "
                                        "(at most max_context_utts) [default: the server's session_context_utts].")


class SessionOut(BaseModel):
    id: str
    context_utts: int
    transcripts: list[str] = Field(..., description="The transcripts kept, oldest first.")
    expires_in_s: float = Field(..., description="Seconds until it ends unless a request comes.")
    waiting: int = Field(..., description="Requests of it being served or waiting for their turn.")


class ErrorResponse(BaseModel):
    detail: str
    type: str
    field: Optional[str] = None
    limit: Optional[float] = None
    errors: Optional[list[dict]] = None
