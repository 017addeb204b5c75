"""Erasure codecs: XOR, Cauchy Reed-Solomon on ISA-L, numpy bit-matrix RS.

Fast (< 30 s): small shards, every erasure pattern of up to m losses for several (k, m).
ISA-L tests are skipped, with the reason, when libisal is absent (scripts/setup.sh installs it).
"""
import itertools
import json
import logging

import numpy as np
import pytest

from megatron_ft.redundancy.codecs import (BitmatrixRSCodec, CodecBufferError, CodecDecodeError, CodecDescriptor,
                                           CodecDescriptorError, CodecMismatchError, CodecParameterError,
                                           CodecUnavailableError, IsalRSCodec, XorCodec, codec_status, get_codec,
                                           gf256, load_isal)
from megatron_ft.redundancy.codecs import isal as isal_mod
from megatron_ft.redundancy.codecs.bitmatrix import cse_schedule, smart_schedule

_LIB, _PROBLEMS = load_isal()
requires_isal = pytest.mark.skipif(
    _LIB is None, reason=f"ISA-L not found ({'; '.join(_PROBLEMS)}); run scripts/setup.sh as root "
                         f"(apt-get install -y libisal2) or pip install 'megatron-ft[isal]'")

# lengths exercising: empty, < 8 bytes (byte-wise tail only), tiny packets, several 64-byte
# packets blocks plus a partial block plus a byte-wise tail, and a SIMD-unfriendly odd size
LENGTHS = (0, 1, 7, 8, 9, 63, 512, 512 * 3 + 8 * 5 + 3, 4099)
SHORT_LENGTHS = (0, 7, 512 * 3 + 8 * 5 + 3, 4099)  # for shapes with many erasure patterns
# (k, m): k > m, k = m, k < m, edge cases 1 and the extremes
RS_SHAPES = [(1, 1), (2, 1), (4, 1), (2, 2), (3, 2), (4, 2), (1, 3), (2, 3), (5, 3), (3, 3), (8, 2), (4, 4)]


def rand_shards(rng, n, length):
    return [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(n)]


def patterns(n, m):
    for lost in range(1, m + 1):
        yield from itertools.combinations(range(n), lost)


def roundtrip_all(codec, length, rng, check_descriptor=True):
    k, m = codec.k, codec.m
    data = rand_shards(rng, k, length)
    parity = [np.full(length, 0x5A, np.uint8) for _ in range(m)]
    codec.encode(data, parity)
    shards = data + parity
    desc = codec.descriptor.to_json() if check_descriptor else None
    for lost in patterns(k + m, m):
        avail = {i: shards[i] for i in range(k + m) if i not in lost}
        out = {e: np.full(length, 0xA5, np.uint8) for e in lost}
        codec.decode(avail, list(lost), out, descriptor=desc)
        for e in lost:
            assert np.array_equal(out[e], shards[e]), (codec, length, lost, e)
    return data, parity


def make(name, k, m, **kw):
    if name == "rs-isal":
        return IsalRSCodec(k, m, **kw)
    if name == "rs-numpy-small":  # 64-byte packets: many blocks, partial blocks, tails in small buffers
        return BitmatrixRSCodec(k, m, packet_bytes=64, **kw)
    if name == "rs-numpy":
        return BitmatrixRSCodec(k, m, **kw)
    raise AssertionError(name)


# ---- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k,m", RS_SHAPES)
@pytest.mark.parametrize("name", [pytest.param("rs-isal", marks=requires_isal), "rs-numpy-small"])
def test_rs_every_erasure_pattern(name, k, m):
    rng = np.random.default_rng(k * 100 + m)
    codec = make(name, k, m)
    many = sum(1 for _ in patterns(k + m, m)) > 40
    for length in SHORT_LENGTHS if many else LENGTHS:
        roundtrip_all(codec, length, rng)


@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (2, 3)])
def test_rs_numpy_default_packets_multi_block_with_tails(k, m):
    codec = BitmatrixRSCodec(k, m)
    P = codec.packet_bytes
    rng = np.random.default_rng(7)
    roundtrip_all(codec, 8 * P * 2 + 8 * 100 + 5, rng)


@pytest.mark.parametrize("name", [pytest.param("rs-isal", marks=requires_isal), "rs-numpy-small"])
def test_rs_largest_shape_sampled_patterns(name):
    k, m = 32, 8
    codec = make(name, k, m)
    rng = np.random.default_rng(3)
    length = 1000 + 64 * 8 * 2  # two full 64-byte-packet blocks plus a partial one and a tail
    data = rand_shards(rng, k, length)
    parity = [np.empty(length, np.uint8) for _ in range(m)]
    codec.encode(data, parity)
    shards = data + parity
    picks = [tuple(range(8)), tuple(range(32, 40)), tuple(sorted(rng.choice(40, 8, replace=False)))]
    for lost in picks[: (3 if name == "rs-isal" else 2)]:
        out = {e: np.empty(length, np.uint8) for e in lost}
        codec.decode({i: shards[i] for i in range(40) if i not in lost}, list(lost), out)
        assert all(np.array_equal(out[e], shards[e]) for e in lost)


@pytest.mark.parametrize("k", [1, 2, 3, 7, 16])
def test_xor_round_trip_and_equals_plain_numpy(k):
    rng = np.random.default_rng(k)
    codec = XorCodec(k, chunk_bytes=4096)
    for length in LENGTHS + (3 * 4096 + 17,):
        data, parity = roundtrip_all(codec, length, rng)
        want = np.zeros(length, np.uint8)
        for d in data:
            want ^= d
        assert np.array_equal(parity[0], want)


def test_decode_rebuilds_parity_only_and_mixed():
    rng = np.random.default_rng(11)
    for codec in [BitmatrixRSCodec(4, 3, packet_bytes=64)] + ([IsalRSCodec(4, 3)] if _LIB else []):
        data = rand_shards(rng, 4, 777)
        par = [np.empty(777, np.uint8) for _ in range(3)]
        codec.encode(data, par)
        out = {5: np.empty(777, np.uint8)}
        codec.decode({i: d for i, d in enumerate(data)}, [5], out)  # all data alive: re-encode one parity
        assert np.array_equal(out[5], par[1])
        # more survivors than needed: extra ones are ignored; only asked-for shards are written
        avail = {0: data[0], 2: data[2], 3: data[3], 4: par[0], 6: par[2]}
        out = {1: np.empty(777, np.uint8)}
        codec.decode(avail, [1], out)
        assert np.array_equal(out[1], data[1])


def test_threads_give_identical_bytes():
    rng = np.random.default_rng(5)
    length = 8 * 1024 * 9 + 13
    for name, kw in [("rs-numpy", dict(packet_bytes=1024)), ("xor", {})] + ([("rs-isal", {})] if _LIB else []):
        one = get_codec(name, 4, 1 if name == "xor" else 2, **kw)
        two = get_codec(name, 4, 1 if name == "xor" else 2, threads=2, **kw)
        data = rand_shards(rng, 4, length)
        p1 = [np.empty(length, np.uint8) for _ in range(one.m)]
        p2 = [np.empty(length, np.uint8) for _ in range(one.m)]
        one.encode(data, p1)
        two.encode(data, p2)
        assert all(np.array_equal(a, b) for a, b in zip(p1, p2))
        out = {0: np.empty(length, np.uint8)}
        two.decode({i: s for i, s in enumerate(data + p2) if i != 0}, [0], out)
        assert np.array_equal(out[0], data[0])
        two.close()


def test_piecewise_encoding_matches_whole_when_pieces_are_aligned():
    rng = np.random.default_rng(12)
    length = 64 * 8 * 7 + 45
    for codec in [BitmatrixRSCodec(3, 2, packet_bytes=64), XorCodec(3)] + ([IsalRSCodec(3, 2)] if _LIB else []):
        data = rand_shards(rng, 3, length)
        whole = [np.empty(length, np.uint8) for _ in range(codec.m)]
        codec.encode(data, whole)
        step = codec.piece_align * 3 if codec.piece_align > 1 else 1001
        pieced = [np.empty(length, np.uint8) for _ in range(codec.m)]
        for lo in range(0, length, step):
            codec.encode([d[lo:lo + step] for d in data], [p[lo:lo + step] for p in pieced])
        assert all(np.array_equal(a, b) for a, b in zip(whole, pieced)), codec
        # decode piecewise with different (aligned) pieces
        step2 = codec.piece_align * 2 if codec.piece_align > 1 else 777
        out = np.empty(length, np.uint8)
        shards = data + whole
        for lo in range(0, length, step2):
            codec.decode({i: shards[i][lo:lo + step2] for i in range(1, 4)}, [0], {0: out[lo:lo + step2]})
        assert np.array_equal(out, data[0])


def test_multidimensional_contiguous_buffers_are_viewed_not_copied():
    codec = BitmatrixRSCodec(2, 1, packet_bytes=64)
    data = [np.arange(512, dtype=np.uint8).reshape(8, 64), np.ones((8, 64), np.uint8)]
    par = np.empty((2, 8, 64), np.uint8)  # parity written into a slice of a bigger arena
    codec.encode(data, [par[1]])
    assert np.array_equal(par[1], data[0] ^ data[1])


# ---- cross-checks against independent references ----------------------------------------------------
@requires_isal
def test_isal_matrix_and_inverse_match_python_gf():
    for k, m in [(1, 1), (4, 2), (32, 8), (10, 4)]:
        assert _LIB.cauchy1(k, m).tolist() == gf256.encode_matrix(k, gf256.cauchy1_matrix(k, m))
    rng = np.random.default_rng(1)
    for k, m in [(4, 2), (8, 3), (32, 8)]:
        full = gf256.encode_matrix(k, gf256.cauchy1_matrix(k, m))
        rows = sorted(rng.choice(k + m, k, replace=False))
        sub = np.array([full[r] for r in rows], np.uint8)
        assert _LIB.invert(sub).tolist() == gf256.mat_inv(sub.tolist())
    assert all(_LIB.gf_mul(a, b) == gf256.mul(a, b) for a in range(0, 256, 7) for b in range(0, 256, 5))


@requires_isal
@pytest.mark.parametrize("k,m", [(3, 2), (8, 4), (2, 5)])
def test_isal_parity_equals_bytewise_gf_reference(k, m):
    rng = np.random.default_rng(k + m)
    data = rand_shards(rng, k, 3001)
    par = [np.empty(3001, np.uint8) for _ in range(m)]
    IsalRSCodec(k, m).encode(data, par)
    ref = [np.empty(3001, np.uint8) for _ in range(m)]
    gf256.matvec_bytes(gf256.cauchy1_matrix(k, m), data, ref, 0, 3001)
    assert all(np.array_equal(a, b) for a, b in zip(par, ref))


def test_reference_rs_isal_without_library_gives_same_bytes_and_decodes(monkeypatch, caplog):
    rng = np.random.default_rng(9)
    k, m, n = 4, 2, 1500
    data = rand_shards(rng, k, n)
    want = [np.empty(n, np.uint8) for _ in range(m)]
    gf256.matvec_bytes(gf256.cauchy1_matrix(k, m), data, want, 0, n)
    if _LIB is not None:  # the library path produces the reference bytes
        got = [np.empty(n, np.uint8) for _ in range(m)]
        IsalRSCodec(k, m).encode(data, got)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    desc = CodecDescriptor(name="rs-isal", version=1, k=k, m=m, field=gf256.FIELD_NAME, matrix="cauchy1",
                           matrix_sha256=gf256.matrix_fingerprint(gf256.cauchy1_matrix(k, m)), layout="bytewise")
    monkeypatch.setattr(isal_mod, "load_isal", lambda refresh=False: (None, ["simulated: no libisal"]))
    with caplog.at_level(logging.WARNING, logger="megatron_ft.redundancy.codecs"):
        dec = get_codec(desc.to_json())
    assert dec.implementation == "numpy-reference"
    assert "slow numpy reference" in caplog.text
    shards = data + want
    out = {0: np.empty(n, np.uint8), 5: np.empty(n, np.uint8)}
    dec.decode({i: shards[i] for i in (1, 2, 3, 4)}, [0, 5], out, descriptor=desc)
    assert np.array_equal(out[0], data[0]) and np.array_equal(out[5], want[1])


def _bitplane_reference(rows, data, P):
    """Independent model of the bit-matrix layout on full blocks: within a block, bit b of byte t
    of packets x=0..7 of shard j form one GF(2^8) symbol (bit x <- packet x); parity symbols are the
    GF(2^8) products; parity packet l holds bit l of each parity symbol."""
    k, length = len(data), data[0].size
    nb = length // (8 * P)
    table = gf256.mul_table()
    out = [np.zeros(nb * 8 * P, np.uint8) for _ in rows]
    weights = (1 << np.arange(8)).astype(np.uint8)
    for blk in range(nb):
        sym = []
        for d in data:
            pk = d[blk * 8 * P:(blk + 1) * 8 * P].reshape(8, P)
            bits = np.unpackbits(pk[:, :, None], axis=2, bitorder="little")  # (x, t, b)
            sym.append(np.tensordot(weights, bits, axes=(0, 0)).astype(np.uint8))  # (t, b)
        for i, row in enumerate(rows):
            q = np.zeros((P, 8), np.uint8)
            for c, s in zip(row, sym):
                q ^= table[c][s]
            qbits = np.unpackbits(q[:, :, None], axis=2, bitorder="little")  # (t, b, l)
            packets = np.packbits(qbits.transpose(2, 0, 1), axis=2, bitorder="little")[:, :, 0]  # (l, t)
            out[i][blk * 8 * P:(blk + 1) * 8 * P] = packets.reshape(-1)
    return out


@pytest.mark.parametrize("k,m", [(2, 1), (3, 2), (4, 4), (2, 5)])
def test_bitmatrix_parity_equals_bitplane_gf_model(k, m):
    P = 64
    codec = BitmatrixRSCodec(k, m, packet_bytes=P)
    rng = np.random.default_rng(k * m)
    data = rand_shards(rng, k, 8 * P * 3)
    par = [np.empty(8 * P * 3, np.uint8) for _ in range(m)]
    codec.encode(data, par)
    ref = _bitplane_reference(codec.parity_rows, data, P)
    assert all(np.array_equal(a, b) for a, b in zip(par, ref))
    # cauchy-good: parity k is plain XOR
    assert np.array_equal(par[0], np.bitwise_xor.reduce(np.stack(data), axis=0))


def test_schedules_compute_the_bitmatrix():
    rng = np.random.default_rng(2)
    for k, m in [(4, 2), (8, 3), (3, 5)]:
        bitrows = gf256.to_bitmatrix(gf256.cauchy_good_matrix(k, m))
        src = rng.integers(0, 2 ** 62, 8 * k, dtype=np.int64).tolist()
        want = [0] * len(bitrows)
        for r, mask in enumerate(bitrows):
            for b in range(8 * k):
                if mask >> b & 1:
                    want[r] ^= src[b]
        for ops, _ in [(smart_schedule(bitrows, 8 * k), 0), cse_schedule(bitrows, 8 * k, 10 ** 6),
                       cse_schedule(bitrows, 8 * k, 3)]:
            vals = dict(enumerate(src))
            for dst, x, y in ops:
                vals[dst] = 0 if x < 0 else (vals[x] if y < 0 else vals[x] ^ vals[y])
            assert [vals[8 * k + r] for r in range(len(bitrows))] == want


def test_cauchy_good_is_mds():
    for k, m in [(4, 2), (3, 3), (2, 4), (5, 3)]:
        full = gf256.encode_matrix(k, gf256.cauchy_good_matrix(k, m))
        for rows in itertools.combinations(range(k + m), k):
            gf256.mat_inv([full[r] for r in rows])  # raises if singular


# ---- descriptors and mismatches -------------------------------------------------------------------
def test_descriptor_json_round_trip_and_canonical():
    for codec in [XorCodec(3), BitmatrixRSCodec(4, 2)] + ([IsalRSCodec(4, 2)] if _LIB else []):
        d = codec.descriptor
        js = d.to_json()
        assert CodecDescriptor.from_any(js) == d
        assert CodecDescriptor.from_any(json.loads(js)) == d
        assert json.loads(js)["name"] == codec.name
        assert get_codec(js).descriptor == d


def test_bad_descriptors_are_clear():
    with pytest.raises(CodecDescriptorError, match="not valid JSON"):
        CodecDescriptor.from_any("{nope")
    good = BitmatrixRSCodec(2, 1).descriptor.to_dict()
    with pytest.raises(CodecDescriptorError, match="unknown field"):
        CodecDescriptor.from_any({**good, "wibble": 1})
    with pytest.raises(CodecDescriptorError, match="missing field"):
        CodecDescriptor.from_any({k: v for k, v in good.items() if k != "layout"})
    with pytest.raises(CodecDescriptorError, match="format_version"):
        CodecDescriptor.from_any({**good, "format_version": 99})
    with pytest.raises(CodecDescriptorError, match="must be an integer"):
        CodecDescriptor.from_any({**good, "k": "2"})
    with pytest.raises(CodecDescriptorError, match="unknown to this build"):
        get_codec({**good, "name": "lrc"})


@requires_isal
def test_isal_and_numpy_refuse_each_others_parity():
    k, m, n = 4, 2, 8 * 64 * 2 + 5
    rng = np.random.default_rng(4)
    data = rand_shards(rng, k, n)
    isal, npy = IsalRSCodec(k, m), BitmatrixRSCodec(k, m, packet_bytes=64)
    p_isal = [np.empty(n, np.uint8) for _ in range(m)]
    p_npy = [np.empty(n, np.uint8) for _ in range(m)]
    isal.encode(data, p_isal)
    npy.encode(data, p_npy)
    assert not np.array_equal(p_isal[1], p_npy[1])  # not byte-compatible
    lost = [0, 3]
    for enc, par, other in [(isal, p_isal, npy), (npy, p_npy, isal)]:
        shards = data + par
        avail = {i: shards[i] for i in range(k + m) if i not in lost}
        # told the right codec: correct
        out = {e: np.empty(n, np.uint8) for e in lost}
        get_codec(enc.descriptor.to_json()).decode(avail, lost, out, descriptor=enc.descriptor)
        assert all(np.array_equal(out[e], data[e]) for e in lost)
        # the other codec refuses, naming what differs
        with pytest.raises(CodecMismatchError) as ei:
            other.decode(avail, lost, out, descriptor=enc.descriptor.to_json())
        msg = str(ei.value)
        assert "name: recorded" in msg and "layout" in msg and "not byte-compatible" in msg
        assert {f for f, _, _ in ei.value.differences} >= {"name", "layout", "matrix"}
        # and that check is what stands between the caller and garbage
        other.decode(avail, lost, out)
        assert not all(np.array_equal(out[e], data[e]) for e in lost)


def test_mismatch_names_each_differing_field():
    enc = BitmatrixRSCodec(4, 2, packet_bytes=4096)
    for other, field in [(BitmatrixRSCodec(4, 2, packet_bytes=8192), "packet_bytes"),
                         (BitmatrixRSCodec(5, 2, packet_bytes=4096), "k"),
                         (BitmatrixRSCodec(4, 3, packet_bytes=4096), "m")]:
        with pytest.raises(CodecMismatchError, match=f"{field}: recorded"):
            other.check(enc.descriptor)
    tampered = {**enc.descriptor.to_dict(), "matrix_sha256": "0" * 16}
    with pytest.raises(CodecMismatchError, match="matrix_sha256"):
        enc.check(tampered)
    with pytest.raises(CodecMismatchError, match="version: recorded 2"):
        get_codec({**enc.descriptor.to_dict(), "version": 2})
    with pytest.raises(CodecMismatchError, match="k=4 but k=5"):
        get_codec(enc.descriptor, 5, 2)
    with pytest.raises(CodecMismatchError, match="name: recorded 'xor'"):
        enc.decode({0: np.zeros(8, np.uint8)}, [], {}, descriptor=XorCodec(4).descriptor)


# ---- factory ----------------------------------------------------------------------------------------
def test_get_codec_by_name():
    assert isinstance(get_codec("xor", 4), XorCodec)
    assert isinstance(get_codec("rs-numpy", 4, 2), BitmatrixRSCodec)
    assert get_codec("rs-numpy", 4, 2, packet_bytes=1024).descriptor.packet_bytes == 1024
    rs = get_codec("RS", 4, 2)
    assert rs.name == ("rs-isal" if _LIB else "rs-numpy")
    assert set(codec_status()) == {"xor", "rs", "rs-isal", "rs-numpy"}


def test_get_codec_falls_back_loudly_without_isal(monkeypatch, caplog):
    import megatron_ft.redundancy.codecs.factory as factory
    monkeypatch.setattr(factory, "load_isal", lambda refresh=False: (None, ["simulated: no libisal"]))
    monkeypatch.setattr(isal_mod, "load_isal", lambda refresh=False: (None, ["simulated: no libisal"]))
    with caplog.at_level(logging.WARNING, logger="megatron_ft.redundancy.codecs"):
        c = get_codec("rs", 4, 2)
    assert c.name == "rs-numpy"
    assert "falling back to the numpy bit-matrix codec 'rs-numpy'" in caplog.text
    assert "simulated: no libisal" in caplog.text and "apt-get install -y libisal2" in caplog.text
    with pytest.raises(CodecUnavailableError, match="libisal2"):
        get_codec("rs-isal", 4, 2)


@requires_isal
def test_isal_found_via_env_var(monkeypatch):
    monkeypatch.setenv(isal_mod.ENV_VAR, _LIB.path)
    lib, _ = isal_mod.load_isal(refresh=True)
    try:
        assert lib is not None and lib.source == "env"
    finally:
        monkeypatch.delenv(isal_mod.ENV_VAR)
        isal_mod.load_isal(refresh=True)


def test_pyeclib_bundled_isal_if_installed():
    cands = isal_mod._pyeclib_candidates()
    if not cands:
        pytest.skip("pyeclib is not installed (optional: pip install 'megatron-ft[isal]')")
    import ctypes
    lib = isal_mod.IsalLibrary(path=cands[0], cdll=ctypes.CDLL(cands[0]), source="pyeclib")
    isal_mod._self_test(lib)


# ---- bad parameters and buffers -----------------------------------------------------------------------
@pytest.mark.parametrize("args,match", [
    (("rs-numpy", 0, 2), r"k=0 is out of range; supported k is 1\.\.32"),
    (("rs-numpy", 33, 2), r"k=33 is out of range"),
    (("rs-numpy", 4, 0), r"m=0 is out of range; supported m is 1\.\.8"),
    (("rs-numpy", 4, 9), r"m=9 is out of range"),
    (("rs-numpy", 4.0, 2), r"k must be an integer"),
    (("rs-numpy", True, 2), r"k must be an integer"),
    (("xor", 4, 2), r"exactly one parity shard"),
    (("xor", 0), r"k=0 is out of range"),
    (("reed-solomon", 4, 2), r"unknown codec 'reed-solomon'"),
    (("rs", None, 2), r"needs k"),
    (("rs", 4), r"needs m"),
])
def test_bad_parameters(args, match):
    with pytest.raises(CodecParameterError, match=match):
        get_codec(*args)


def test_bad_constructor_options():
    with pytest.raises(CodecParameterError, match="packet_bytes must be a multiple of 64"):
        BitmatrixRSCodec(4, 2, packet_bytes=100)
    with pytest.raises(CodecParameterError, match="threads must be"):
        XorCodec(4, threads=0)
    with pytest.raises(CodecParameterError, match="only applies to the rs-numpy"):
        get_codec("xor", 4, packet_bytes=1024)
    if _LIB:
        with pytest.raises(CodecParameterError, match="m=9"):
            IsalRSCodec(4, 9)


def test_bad_buffers():
    c = BitmatrixRSCodec(2, 2, packet_bytes=64)
    d = [np.zeros(100, np.uint8), np.zeros(100, np.uint8)]
    p = [np.zeros(100, np.uint8), np.zeros(100, np.uint8)]
    with pytest.raises(CodecBufferError, match="k=2 data shards, got 1"):
        c.encode(d[:1], p)
    with pytest.raises(CodecBufferError, match="m=2 parity buffers, got 1"):
        c.encode(d, p[:1])
    with pytest.raises(CodecBufferError, match="dtype uint8"):
        c.encode([d[0], np.zeros(25, np.float32)], p)
    with pytest.raises(CodecBufferError, match="numpy.ndarray"):
        c.encode([d[0], bytearray(100)], p)
    with pytest.raises(CodecBufferError, match="C-contiguous"):
        c.encode([d[0], np.zeros(200, np.uint8)[::2]], p)
    with pytest.raises(CodecBufferError, match="same length"):
        c.encode([d[0], np.zeros(101, np.uint8)], p)
    ro = np.zeros(100, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(CodecBufferError, match="read-only"):
        c.encode(d, [p[0], ro])
    with pytest.raises(CodecBufferError, match="overlaps"):
        c.encode(d, [p[0], d[1]])
    arena = np.zeros(300, np.uint8)
    with pytest.raises(CodecBufferError, match="overlaps"):
        c.encode(d, [arena[:100], arena[50:150]])
    c.encode(d, [arena[:100], arena[100:200]])  # adjacent slices of one arena are fine
    with pytest.raises(CodecBufferError, match="lists of arrays"):
        c.encode(np.zeros((2, 100), np.uint8), p)


def test_bad_decode_requests():
    c = BitmatrixRSCodec(3, 2, packet_bytes=64)
    s = [np.zeros(64, np.uint8) for _ in range(5)]
    buf = np.zeros(64, np.uint8)
    with pytest.raises(CodecDecodeError, match=r"2 shard\(s\) available \[0, 1\] but rs-numpy with k=3, m=2 needs"):
        c.decode({0: s[0], 1: s[1]}, [2, 3, 4], {2: buf, 3: buf.copy(), 4: buf.copy()})
    with pytest.raises(CodecDecodeError, match="out of range 0..4"):
        c.decode({0: s[0], 1: s[1], 2: s[2]}, [5], {5: buf})
    with pytest.raises(CodecDecodeError, match="both as available and as erased"):
        c.decode({0: s[0], 1: s[1], 2: s[2]}, [2], {2: buf})
    with pytest.raises(CodecDecodeError, match="twice"):
        c.decode({0: s[0], 1: s[1], 2: s[2]}, [3, 3], {3: buf})
    with pytest.raises(CodecBufferError, match=r"no buffer for erased shard\(s\) \[4\]"):
        c.decode({0: s[0], 1: s[1], 2: s[2]}, [3, 4], {3: buf})
    with pytest.raises(CodecBufferError, match="overlaps"):
        c.decode({0: s[0], 1: s[1], 2: s[2]}, [3], {3: s[0]})
    with pytest.raises(CodecDecodeError, match="must be an int"):
        c.decode({0: s[0], 1: s[1], 2: s[2]}, ["3"], {"3": buf})
    x = XorCodec(2)
    with pytest.raises(CodecDecodeError, match="needs any 2 of the 3"):
        x.decode({0: s[0]}, [1, 2], {1: buf, 2: buf.copy()})
