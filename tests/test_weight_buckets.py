"""Weight-push buckets: grouping, the producer thread's packing (bf16 and fp32 mixed) read back
bitwise by the receiving side's ``unflatten``, the two-slot limit, and errors from the source."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_sat.platform.host_copy import copy_bytes_into
from megatron_sat.rollout.embedded.server import unflatten
from megatron_sat.weight_sync.buckets import BucketProducer, iter_buckets, pack_into


def _model_like() -> list[tuple[str, torch.Tensor]]:
    """A bf16 trainer's export: bf16 weights (odd lengths too), fp32 router and expert bias."""
    g = torch.Generator().manual_seed(0)
    out = []
    for layer in range(3):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
            (p + "mlp.gate.weight", torch.randn(4, 6, generator=g)),  # fp32 router
            (p + "mlp.gate.e_score_correction_bias", torch.randn(4, generator=g)),
            (p + "mlp.experts.0.up_proj.weight", torch.randn(5, 6, generator=g).bfloat16()),
            (p + "mlp.experts.1.up_proj.weight", torch.randn(5, 6, generator=g).bfloat16()),
        ]
    # Values only bf16 has bit patterns for (NaN payloads, -0, subnormals) must survive too.
    special = torch.tensor([0x7FC1, -0x8000, 0x0001, -0x0080], dtype=torch.int16)
    out.append(("special", special.view(torch.bfloat16)))
    return out


def test_iter_buckets_respects_the_limit_and_marks_the_last():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([3, 3, 10, 1, 1])]  # fp32 bytes
    groups = list(iter_buckets(tensors, bucket_bytes=24))
    assert [([n for n, _ in b], last) for b, last, packed in groups if packed] == [
        (["t0", "t1"], False),
        (["t2"], False),  # 40 bytes > 24: alone
        (["t3", "t4"], True),
    ]
    with pytest.raises(ValueError, match="'t0' appears twice"):
        list(iter_buckets([tensors[0], tensors[0]], 100))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(tensors, 0))


@pytest.mark.parametrize("bucket_bytes", [1, 64, 10**6])
def test_packed_buckets_unflatten_bitwise(bucket_bytes):
    tensors = _model_like()
    staging: list = [None, None]
    seen = {}
    with BucketProducer(
        iter(tensors), bucket_bytes, torch.device("cpu"), flatten=True, staging=staging
    ) as producer:
        buckets = []
        for bucket in producer:
            bucket.wait_packed()
            specs = [
                (n, getattr(torch, d), tuple(s))
                for n, d, s in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True)
            ]
            assert bucket.flat.numel() == bucket.num_bytes
            # The receiver's side: every tensor viewed in place (aligned by pack_order).
            for name, got in zip(bucket.names, unflatten(bucket.flat.clone(), specs), strict=True):
                seen[name] = got
            buckets.append(bucket.is_last)
            producer.release(bucket)
    assert buckets[-1] and not any(buckets[:-1])
    assert set(seen) == {n for n, _ in tensors}
    for name, t in tensors:
        assert seen[name].dtype == t.dtype and seen[name].shape == t.shape, name
        # Bitwise, not just equal (NaN payloads, -0).
        assert torch.equal(seen[name].view(torch.uint8), t.view(torch.uint8)), name
    assert seen["model.layers.0.mlp.gate.weight"].dtype == torch.float32


def test_unflattened_per_tensor_buckets_are_the_tensors():
    tensors = _model_like()
    with BucketProducer(
        iter(tensors), 100, torch.device("cpu"), flatten=False, staging=[None, None]
    ) as producer:
        got = {}
        for bucket in producer:
            assert bucket.flat is None
            got.update(zip(bucket.names, bucket.tensors, strict=True))
            producer.release(bucket)
    assert all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors)


def test_producer_holds_at_most_two_buckets_ahead():
    read = []

    def source():
        for i in range(10):
            read.append(i)
            yield f"t{i}", torch.full((4,), float(i))

    producer = BucketProducer(source(), 16, torch.device("cpu"), flatten=True, staging=[None, None])
    with producer:
        buckets = iter(producer)
        first = next(buckets)
        second = next(buckets)
        threading.Event().wait(0.3)  # the thread would run ahead now if it could
        # Two buckets built (one tensor each) and the one tensor iter_buckets reads ahead.
        assert read == [0, 1, 2]
        first.wait_packed()
        assert torch.equal(first.flat.view(torch.float32), torch.zeros(4))
        # A host bucket is handed out before it is packed, and packed only once the bucket
        # before it is released (its broadcast done): the copy then runs while the server
        # loads that bucket, not beside the wire.
        assert not second.packed.wait(0.3)
        producer.release(first)
        second.wait_packed()
        assert torch.equal(second.flat.view(torch.float32), torch.ones(4))
        third = next(buckets)
        assert not third.packed.wait(0.3)
        assert torch.equal(second.flat.view(torch.float32), torch.ones(4))
        producer.release(second)
        third.wait_packed()
        # Bucket 2 reused bucket 0's buffer.
        assert third.flat.data_ptr() == first.flat.data_ptr()
        assert torch.equal(third.flat.view(torch.float32), torch.full((4,), 2.0))
    # Leaving early stops the thread; the caller can drain the rest itself.
    assert len(read) <= 5


def test_source_error_reaches_the_sender():
    def source():
        yield "a", torch.zeros(2)
        raise RuntimeError("gather failed on rank 3")

    with pytest.raises(RuntimeError, match="gather failed on rank 3"):
        with BucketProducer(
            source(), 4, torch.device("cpu"), flatten=True, staging=[None]
        ) as producer:
            for bucket in producer:
                producer.release(bucket)


def test_a_bucket_left_unpacked_raises_when_awaited():
    # The sender stops (a failed broadcast) while bucket 1 waits for bucket 0's release.
    tensors = [(f"t{i}", torch.full((4,), float(i))) for i in range(3)]
    with BucketProducer(
        iter(tensors), 16, torch.device("cpu"), flatten=True, staging=[None, None]
    ) as producer:
        buckets = iter(producer)
        next(buckets)
        second = next(buckets)
    with pytest.raises(RuntimeError, match="stopped before this bucket was packed"):
        second.wait_packed()


def test_copy_bytes_into_checks_sizes():
    a, b = torch.arange(3, dtype=torch.int16), torch.tensor([1.5], dtype=torch.float64)
    flat = torch.empty(14, dtype=torch.uint8)
    copy_bytes_into(flat, [a, b])
    assert torch.equal(flat[:6].view(torch.int16), a)
    assert torch.equal(flat[6:].clone().view(torch.float64), b)  # unaligned: copied to view
    with pytest.raises(ValueError, match=r"uint8 \[14\]"):
        copy_bytes_into(torch.empty(13, dtype=torch.uint8), [a, b])
    assert torch.equal(pack_into([a], torch.zeros(100, dtype=torch.uint8)).view(torch.int16), a)


def test_large_tensors_form_unpacked_buckets_of_their_own():
    tensors = [("s0", torch.zeros(2)), ("L0", torch.zeros(8)), ("s1", torch.zeros(2))]
    tensors += [("L1", torch.zeros(8)), ("L2", torch.zeros(8)), ("s2", torch.zeros(1))]
    groups = list(iter_buckets(tensors, bucket_bytes=64, unpacked_from_bytes=32))
    assert [([n for n, _ in g], last, packed) for g, last, packed in groups] == [
        (["L0", "L1"], False, False),  # 64 bytes: L2 does not fit
        (["s0", "s1", "s2"], False, True),
        (["L2"], True, False),
    ]


@pytest.mark.slow
def test_mixed_wire_formats_load_the_same_weights(tiny_checkpoint):
    """Small tensors flattened, large ones one broadcast each: the server ends with exactly
    the weights an all-flattened push of the same tensors gives (bitwise-equal log-probs of
    seeded samples), and another push in between changes them (the check can fail)."""
    from safetensors.torch import load_file

    from megatron_sat.rollout.client import SamplingParams
    from megatron_sat.rollout.embedded.launch import EmbeddedServer
    from megatron_sat.weight_sync.broadcast import WeightUpdater

    base = sorted(load_file(str(tiny_checkpoint / "model.safetensors")).items())
    gen = torch.Generator().manual_seed(0)
    a = [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in base]
    b = [(n, t - 0.05 * torch.randn(t.shape, generator=gen)) for n, t in base]
    sizes = sorted(t.numel() * t.element_size() for _, t in a)
    split = sizes[len(sizes) // 2]  # about half the tensors travel unpacked
    params = SamplingParams(temperature=1.0, max_new_tokens=6, sampling_seed=7)

    def logprobs(client):
        return [o.output_token_logprobs for o in client.generate([[5, 6, 7], [9, 1]], params)]

    with EmbeddedServer(tiny_checkpoint, random_seed=0) as server:
        client = server.client()
        with (
            WeightUpdater([client], bucket_bytes=4096, unpacked_from_bytes=split) as mixed,
            WeightUpdater([client], bucket_bytes=4096, unpacked_from_bytes=None) as flat,
        ):
            stats = mixed.update(a, weight_version="a-mixed")
            assert stats.num_tensors == len(a)
            with_mixed = logprobs(client)
            flat.update(b, weight_version="b")
            assert logprobs(client) != with_mixed
            flat.update(a, weight_version="a-flat")
            assert logprobs(client) == with_mixed
