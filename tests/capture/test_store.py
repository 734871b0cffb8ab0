"""The hidden-states shard format: round trips, fp8 size and accuracy, verification catches damage."""

from __future__ import annotations

import torch

from eagle3_pipeline.capture import store


def samples(hidden=576, num_aux=3, lengths=(37, 5, 120), seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Real residual streams have a few large outlier channels: per-token scales must cope with them.
    out = []
    for i, length in enumerate(lengths):
        aux = torch.randn(length, num_aux, hidden, generator=generator)
        aux[..., 7] *= 300
        out.append(store.SampleStates(f"s{i}", aux.bfloat16(), torch.randn(length, hidden, generator=generator).bfloat16()))
    return out


def test_bf16_round_trip_is_exact(tmp_path):
    written = samples()
    entries = store.write_shard(tmp_path / "shard_00000.safetensors", written, "bfloat16")
    written_layout = store.StatesLayout([2, 15, 27], 30, "vLLM", 576, "bfloat16")
    store.write_index(tmp_path, entries, written_layout, dict.fromkeys(entries, "train"))
    reader, layout = store.open_reader(tmp_path)
    assert layout == written_layout
    for sample in written:
        aux, final = reader.get(sample.sample_id)
        assert torch.equal(aux, sample.aux) and torch.equal(final, sample.final)


def test_fp8_halves_the_disk_and_stays_within_fp8_tolerance(tmp_path):
    written = samples()
    store.write_shard(tmp_path / "bf16.safetensors", written, "bfloat16")
    entries = store.write_shard(tmp_path / "fp8.safetensors", written, "fp8")
    ratio = (tmp_path / "fp8.safetensors").stat().st_size / (tmp_path / "bf16.safetensors").stat().st_size
    print(f"fp8 / bf16 bytes: {ratio:.4f}")
    assert ratio <= 0.53
    assert abs(ratio - store.bytes_per_token(3, 576, "fp8") / store.bytes_per_token(3, 576, "bfloat16")) < 0.01
    reader = store.HiddenStatesReader(tmp_path, entries)
    for sample in written:
        aux, final = reader.get(sample.sample_id)
        for got, want in ((aux, sample.aux), (final, sample.final)):
            want = want.float()
            # e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4, measured per vector scale
            error = (got.float() - want).abs() / want.abs().amax(dim=-1, keepdim=True)
            assert error.max() <= 2**-4, error.max()
            relative = ((got.float() - want).norm() / want.norm()).item()
            print(f"{sample.sample_id}: relative error {relative:.4f}")
            assert relative < 0.05


def test_verify_catches_wrong_counts_dtypes_and_truncation(tmp_path):
    path = tmp_path / "shard.safetensors"
    store.write_shard(path, samples(), "fp8")
    tokens = 37 + 5 + 120
    assert store.verify_shard(path, tokens, 3, 576, "fp8") is None
    assert "expected (163, 3, 576)" in store.verify_shard(path, tokens + 1, 3, 576, "fp8")
    assert "tensors" in store.verify_shard(path, tokens, 3, 576, "bfloat16")
    (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert "unreadable" in store.verify_shard(tmp_path / "cut.safetensors", tokens, 3, 576, "fp8")


def test_all_finite_reads_the_exponent_bits_as_isfinite_does():
    """The bit test against torch.isfinite on bf16, fp8 and float32: large finite values, subnormals, zeros, and
    a NaN, +inf or -inf anywhere (e4m3fn has no inf: torch saturates one to 448)."""
    from eagle3_pipeline.capture.store import FP8, all_finite

    finite = torch.tensor([0.0, -0.0, 1e-40, -3.0e38, 3.0e38, 448.0, -1.5, 2.0 ** -9])
    for dtype in (torch.bfloat16, FP8, torch.float32):
        values = finite.clamp(-448, 448).to(dtype) if dtype == FP8 else finite.to(dtype)
        assert all_finite(values) and bool(torch.isfinite(values.float()).all())
        for bad in (float("nan"),) if dtype == FP8 else (float("nan"), float("inf"), float("-inf")):
            spoiled = values.clone()
            spoiled[3] = torch.tensor(bad).to(dtype)
            assert not all_finite(spoiled), (dtype, bad)
            assert all_finite(spoiled) == bool(torch.isfinite(spoiled.float()).all())
    assert all_finite(torch.empty(0, 4, dtype=torch.bfloat16))


def test_safetensors_bytes_is_what_safetensors_writes(tmp_path):
    """Byte for byte the library's own serialisation (one metadata key: the library orders several by hash), and
    with several keys the same tensors and metadata read back by the library."""
    from safetensors import safe_open
    from safetensors.torch import save

    metadata = {"position": "7", "epoch": "0", "samples": '[["s0", 37]]'}
    for dtype in ("bfloat16", "fp8"):
        tensors = store.encode_states(samples(), dtype)
        assert store.safetensors_bytes(tensors, {"position": "7"}) == save(tensors, metadata={"position": "7"})
        (tmp_path / "item.safetensors").write_bytes(store.safetensors_bytes(tensors, metadata))
        with safe_open(tmp_path / "item.safetensors", "pt") as item:
            assert item.metadata() == metadata and set(item.keys()) == set(tensors)
            for name, tensor in tensors.items():
                assert torch.equal(item.get_tensor(name).view(torch.uint8), tensor.view(torch.uint8))
