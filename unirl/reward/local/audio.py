"""Weight-free scorers of the soundtracks an audio-video family (LTX-2) samples beside its videos:
loudness, and how much of the sound is one tone."""

from __future__ import annotations

import math

import torch

from unirl.types.reward import RewardRequest

FLOOR_DBFS = -100.0
"""The loudness of silence: dBFS scores are clamped here (log of 0)."""


def loudness_dbfs(audio: torch.Tensor) -> torch.Tensor:
    """[B] loudness in dB relative to full scale of waveforms [B, A, T] (about [-1, 1]): 20 log10 of
    the RMS over channels and samples, at least `FLOOR_DBFS`. A full-scale sine is -3.01 dBFS."""
    rms = audio.float().pow(2).mean(dim=(1, 2)).sqrt()
    return (20.0 * torch.log10(rms.clamp_min(10 ** (FLOOR_DBFS / 20)))).clamp_min(FLOOR_DBFS)


class Loudness:
    """Scorer: the soundtrack's loudness (`loudness_dbfs`), or with `target_dbfs` the negated
    distance to it in dB (0 at the target).

    Args:
        target_dbfs: the wanted loudness in dBFS (<= 0), or None to reward louder sound.
    """

    def __init__(self, target_dbfs: float | None = None) -> None:
        if target_dbfs is not None and not (math.isfinite(target_dbfs) and FLOOR_DBFS <= target_dbfs <= 0.0):
            raise ValueError(
                f"Loudness target_dbfs must be in [{FLOOR_DBFS}, 0] dBFS or null, got {target_dbfs!r}"
            )
        self.target_dbfs = target_dbfs

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.audio` ([B, A, T])."""
        audio, _ = req.require_audio("Loudness")
        db = loudness_dbfs(audio)
        return db if self.target_dbfs is None else -(db - self.target_dbfs).abs()


def band_power_fraction(audio: torch.Tensor, rate: int, low: float, high: float) -> torch.Tensor:
    """[B] the fraction in [0, 1] of the power of each soundtrack ([B, A, T] at `rate` Hz, the
    channels averaged to mono, the mean removed, a Hann window) at frequencies in [low, high] Hz;
    0 for silence."""
    mono = audio.float().mean(dim=1)
    mono = mono - mono.mean(dim=1, keepdim=True)
    window = torch.hann_window(mono.shape[1], periodic=False, dtype=mono.dtype, device=mono.device)
    power = torch.fft.rfft(mono * window).abs().pow(2)
    freqs = torch.fft.rfftfreq(mono.shape[1], d=1.0 / rate).to(mono.device)
    band = (freqs >= low) & (freqs <= high)
    total = power.sum(dim=1)
    return torch.where(total > 0, power[:, band].sum(dim=1) / total.clamp_min(1e-30), torch.zeros_like(total))


class ToneScore:
    """Scorer: the fraction of the soundtrack's power within `bandwidth` Hz of `frequency`
    (`band_power_fraction`), in [0, 1]: 1 for a pure tone at that frequency, about 2 bandwidth /
    (rate / 2) for white noise.

    Args:
        frequency: the wanted tone in Hz (below the request's Nyquist frequency, rate / 2).
        bandwidth: the half-width in Hz of the band counted as the tone (> 0; at least the
            spectrum's bin spacing, rate / samples, for a short clip).
    """

    def __init__(self, frequency: float, bandwidth: float = 100.0) -> None:
        if not (math.isfinite(frequency) and frequency > 0):
            raise ValueError(f"ToneScore frequency must be > 0 Hz, got {frequency!r}")
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"ToneScore bandwidth must be > 0 Hz, got {bandwidth!r}")
        self.frequency, self.bandwidth = float(frequency), float(bandwidth)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.audio` ([B, A, T] at `req.audio_rate`)."""
        audio, rate = req.require_audio("ToneScore")
        if self.frequency >= rate / 2:
            raise ValueError(
                f"ToneScore frequency={self.frequency} Hz is at or above the soundtrack's Nyquist frequency "
                f"{rate / 2} Hz (sample rate {rate} Hz): pick a frequency below it"
            )
        return band_power_fraction(
            audio, rate, self.frequency - self.bandwidth, self.frequency + self.bandwidth
        )
