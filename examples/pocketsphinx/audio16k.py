"""WAV input and output for the PocketSphinx example: 16-bit PCM only, converted to 16 kHz mono.

PocketSphinx's bundled en-us acoustic model expects 16 kHz, 16-bit, mono audio. Speech synthesisers write other
rates (espeak-ng: 22,050 Hz), so audio is down-mixed and resampled here with numpy alone (no scipy, sox or
torchaudio needed).
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

TARGET_RATE = 16_000


class AudioError(ValueError):
    """A WAV file is missing, not 16-bit PCM, or empty; the message names the file."""


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Samples as float64 (T, C) in [-1, 1) and the sample rate in Hz. Only 16-bit PCM is accepted."""
    path = Path(path)
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except FileNotFoundError:
        raise AudioError(f"{path}: WAV file not found") from None
    except (wave.Error, EOFError) as e:
        raise AudioError(f"{path}: not a PCM WAV file ({e})") from None
    if width != 2:
        raise AudioError(f"{path}: {8 * width}-bit samples; only 16-bit PCM is supported (convert with sox)")
    x = np.frombuffer(raw, dtype="<i2").astype(np.float64) / 32768.0
    if x.size == 0:
        raise AudioError(f"{path}: no samples")
    return x.reshape(-1, channels), rate  # (T, C)


def resample(x: np.ndarray, rate: int, target: int = TARGET_RATE) -> np.ndarray:
    """Band-limited resampling of a mono signal (T,) from `rate` to `target` Hz by FFT truncation/zero-padding.

    Exact for a periodic signal; the signal is zero-padded by 0.1 s on both sides first so that the implied
    wrap-around joins silence to silence instead of the end of the utterance to its start. Frequencies above
    the new Nyquist frequency are removed (the anti-aliasing filter is the truncation itself).
    """
    if rate == target:
        return x.copy()
    pad = rate // 10
    xp = np.pad(x, (pad, pad))
    n = xp.size
    m = int(round(n * target / rate))
    spectrum = np.fft.rfft(xp)
    k = min(spectrum.size, m // 2 + 1)
    out_spec = np.zeros(m // 2 + 1, dtype=complex)
    out_spec[:k] = spectrum[:k]
    y = np.fft.irfft(out_spec, m) * (m / n)  # irfft divides by m, rfft did not divide by n
    cut = int(round(pad * target / rate))
    return y[cut: m - cut]


def to_pcm16(x: np.ndarray) -> bytes:
    """(T,) float in [-1, 1) -> little-endian 16-bit PCM bytes, clipped."""
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()


def load_16k_mono(path: str | Path) -> tuple[bytes, bool]:
    """The audio of `path` as 16 kHz mono 16-bit PCM bytes, and whether it had to be converted."""
    x, rate = read_wav(path)
    converted = x.shape[1] != 1 or rate != TARGET_RATE
    mono = x.mean(axis=1)  # (T,)
    return to_pcm16(resample(mono, rate)), converted


def write_wav(path: str | Path, pcm: bytes, rate: int = TARGET_RATE) -> None:
    """Write mono 16-bit PCM bytes as a WAV file."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
