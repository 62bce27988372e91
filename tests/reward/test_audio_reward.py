"""The soundtrack scorers against closed forms: a sine's RMS is A / sqrt(2), a pure tone's power
lies in one band, white noise's spreads evenly; and the request's audio contract."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.reward.local import Loudness, ToneScore
from unirl.reward.local.audio import band_power_fraction, loudness_dbfs
from unirl.types.reward import RewardRequest

RATE = 16000


def request(audio: torch.Tensor, rate: int = RATE) -> RewardRequest:
    b = audio.shape[0]
    frames = torch.zeros(b, 2, 3, 4, 4, dtype=torch.uint8)
    return RewardRequest([f"s{i}" for i in range(b)], ["p"] * b, images=frames, audio=audio, audio_rate=rate)


def tone(freq: float, amp: float, samples: int = 1600, channels: int = 2) -> torch.Tensor:
    t = torch.arange(samples, dtype=torch.float64) / RATE
    return (amp * torch.sin(2 * math.pi * freq * t)).float().expand(channels, samples)


def test_loudness_is_the_rms_in_dbfs() -> None:
    audio = torch.stack([tone(1000, 1.0), tone(1000, 0.1), torch.zeros(2, 1600)])
    want = [20 * math.log10(1 / math.sqrt(2)), 20 * math.log10(0.1 / math.sqrt(2)), -100.0]
    torch.testing.assert_close(Loudness()(request(audio)), torch.tensor(want), atol=1e-3, rtol=0)
    torch.testing.assert_close(
        Loudness(target_dbfs=-20.0)(request(audio)), -(torch.tensor(want) + 20).abs(), atol=1e-3, rtol=0
    )
    # channels pool: one silent channel of two halves the power (-3.01 dB)
    half = tone(1000, 1.0).clone()
    half[1] = 0
    assert loudness_dbfs(half[None]).item() == pytest.approx(want[0] - 10 * math.log10(2), abs=1e-3)


def test_tone_score_finds_the_tone_and_spreads_noise() -> None:
    # 1000 Hz sits on a bin (1600 samples at 16 kHz: 10 Hz bins)
    audio = torch.stack([tone(1000, 0.5), tone(3000, 0.5), tone(1000, 0.5) + tone(3000, 0.5)])
    scores = ToneScore(frequency=1000, bandwidth=100)(request(audio))
    assert scores[0] > 0.999 and scores[1] < 1e-3 and scores[2] == pytest.approx(0.5, abs=1e-3)
    noise = torch.randn(4, 1, 16000, generator=torch.Generator().manual_seed(0))
    frac = band_power_fraction(noise, RATE, 1000.0, 3000.0)  # 2000 of 8000 Hz
    torch.testing.assert_close(frac, torch.full((4,), 0.25), atol=0.02, rtol=0)
    assert band_power_fraction(torch.zeros(1, 1, 100), RATE, 0.0, 8000.0).item() == 0.0


def test_bad_audio_input_is_named() -> None:
    frames = torch.zeros(1, 2, 3, 4, 4, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"Loudness scores audio, but the request carries videos without audio"
    ):
        Loudness()(RewardRequest(["s0"], ["p"], images=frames))
    with pytest.raises(ValueError, match=r"ToneScore scores audio, but the request carries text"):
        ToneScore(440.0)(RewardRequest(["s0"], ["p"], texts=["x"]))
    with pytest.raises(ValueError, match=r"at or above the soundtrack's Nyquist frequency 4000.0 Hz"):
        ToneScore(5000.0)(request(tone(1000, 0.5)[None], rate=8000))
    with pytest.raises(ValueError, match=r"audio must be float \[B=1, channels, samples\]"):
        RewardRequest(["s0"], ["p"], images=frames, audio=torch.zeros(1, 100), audio_rate=RATE)
    with pytest.raises(ValueError, match=r"audio_rate must be the waveforms' sample rate"):
        RewardRequest(["s0"], ["p"], images=frames, audio=torch.zeros(1, 1, 100))
    with pytest.raises(ValueError, match=r"audio comes beside images or videos"):
        RewardRequest(["s0"], ["p"], texts=["x"], audio=torch.zeros(1, 1, 100), audio_rate=RATE)
    with pytest.raises(ValueError, match=r"ToneScore frequency must be > 0"):
        ToneScore(0.0)
    with pytest.raises(ValueError, match=r"Loudness target_dbfs must be in"):
        Loudness(target_dbfs=3.0)
