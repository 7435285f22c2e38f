"""Synthesise test utterances: one sentence per line -> OUT/<prefix>NNNN.wav (16 kHz mono 16-bit) + OUT/ref.txt.

    python examples/pocketsphinx/make_wavs.py sentences.txt -o wavs/

Speech comes from espeak-ng (`espeak-ng -w x.wav "text"`, 22,050 Hz) or, when it is missing, Festival's
`text2wave`; it is resampled to the 16 kHz PocketSphinx expects with sox where installed, else with numpy
(audio16k.py). `ref.txt` holds `utt word word ...` in the form `smallstate-lm rescore --refs` reads.

Expect a high word error rate: espeak-ng's formant voices are far from the speech PocketSphinx's en-us model
was trained on (70-80% WER on the first sentences of data/valid.txt with the default voice below, the best of
the few voices tried; Festival's voices do much better). That leaves room for rescoring.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from audio16k import load_16k_mono, write_wav


def synthesise(text: str, wav: Path, tts: str, voice: str, speed: int) -> None:
    """Write `text` as speech to `wav` (the synthesiser's own rate)."""
    if tts == "espeak-ng":
        cmd = ["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(wav), text]
        subprocess.run(cmd, check=True, capture_output=True)
    else:
        subprocess.run(["text2wave", "-o", str(wav)], input=text, text=True, check=True, capture_output=True)


def to_16k(src: Path, dst: Path, resampler: str) -> None:
    if resampler == "sox":
        subprocess.run(["sox", str(src), "-r", "16000", "-c", "1", "-b", "16", str(dst)], check=True,
                       capture_output=True)
    else:
        pcm, _ = load_16k_mono(src)
        write_wav(dst, pcm)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sentences", type=Path, help="text file, one sentence per line")
    p.add_argument("-o", "--out", type=Path, required=True, help="output directory")
    p.add_argument("--prefix", default="utt", help="utterance id prefix (default utt)")
    p.add_argument("--tts", choices=["auto", "espeak-ng", "festival"], default="auto")
    p.add_argument("--voice", default="en-us+f2", help="espeak-ng voice (default en-us+f2)")
    p.add_argument("--speed", type=int, default=130, help="espeak-ng words per minute (default 130)")
    p.add_argument("--resampler", choices=["auto", "sox", "numpy"], default="auto")
    args = p.parse_args(argv)

    tts = args.tts
    if tts == "auto":
        tts = "espeak-ng" if shutil.which("espeak-ng") else "festival" if shutil.which("text2wave") else ""
    if not tts or not shutil.which("espeak-ng" if tts == "espeak-ng" else "text2wave"):
        p.error("no speech synthesiser: install espeak-ng (apt-get install espeak-ng) or festival")
    resampler = args.resampler
    if resampler == "auto":
        resampler = "sox" if shutil.which("sox") else "numpy"
    sentences = [" ".join(line.split()) for line in args.sentences.read_text(encoding="utf-8").splitlines()]
    sentences = [s for s in sentences if s]
    if not sentences:
        p.error(f"{args.sentences}: no sentences")
    args.out.mkdir(parents=True, exist_ok=True)
    refs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(sentences):
            utt = f"{args.prefix}{i:04d}"
            raw = Path(tmp) / f"{utt}.wav"
            synthesise(text, raw, tts, args.voice, args.speed)
            to_16k(raw, args.out / f"{utt}.wav", resampler)
            refs.append(f"{utt} {text.lower()}\n")
    (args.out / "ref.txt").write_text("".join(refs), encoding="utf-8")
    print(f"{len(sentences)} utterances ({tts}, resampled with {resampler}) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
