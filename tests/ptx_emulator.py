"""A small emulator of the PTX opcodes the kernels' inline asm uses, bit for bit, so that the exact
asm string the GPU compiles can be checked on a CPU (tests/test_fp4_ptx.py).

Operands follow Triton's ``tl.inline_asm_elementwise`` convention: ``$0 .. $(n_out - 1)`` are the
outputs, then the inputs in order; the constraint string gives each operand's width ("h" 16-bit,
"r" 32-bit). Supported: ``.reg .b16/.b32`` declarations (writes truncate to the width), ``mov.b32`` (immediate, register, pack
``{a, b}`` and unpack), ``and/or/xor/not.b32``, ``lop3.b32``, ``shf.{l,r}.{wrap,clamp}.b32``,
``shl/shr.b32``, ``shr.s32``, ``prmt.b32`` (default mode), ``add/sub.{u32,s32}``, ``mad.lo.u32``,
``fma.rn.bf16x2`` and ``mul.rn.bf16x2`` (IEEE round to nearest even, subnormals kept, no flush).
Anything else raises ``UnsupportedPTX``: a later change to the asm cannot pass unchecked.
"""

from __future__ import annotations

import math
import re
import struct
from fractions import Fraction

M32 = 0xFFFFFFFF


class UnsupportedPTX(ValueError):
    pass


def bf16_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _exp2(a: Fraction) -> int:
    """floor(log2(a)) of a positive Fraction."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    return e if Fraction(2) ** e <= a else e - 1


def round_to_bf16(value: Fraction, zero_sign: int = 0) -> int:
    """Round an exact value to bf16 bits: nearest even, subnormals kept, overflow to inf.
    zero_sign (0 or 0x8000): the sign IEEE gives an exact zero result."""
    if value == 0:
        return zero_sign
    sign = 0x8000 if value < 0 else 0
    a = abs(value)
    quantum = Fraction(2) ** (max(_exp2(a), -126) - 7)  # 8 significant bits, 2^-133 steps below 2^-126
    v = round(a / quantum) * quantum  # Fraction rounding is ties-to-even
    if v > _BF16_MAX:
        return sign | 0x7F80
    if v == 0:
        return sign
    bits = struct.unpack("<I", struct.pack("<f", float(v)))[0]  # exact: v is a bf16 value
    assert bits & 0xFFFF == 0, v
    return sign | (bits >> 16)


def _bf16_exact(bits: int) -> Fraction:
    x = bf16_to_float(bits)
    if math.isinf(x) or math.isnan(x):
        raise UnsupportedPTX("bf16x2 arithmetic on inf/NaN is not emulated")
    return Fraction(x)


_BF16_MAX = Fraction(bf16_to_float(0x7F7F))


def _bf16x2(op, a: int, b: int, c: int | None) -> int:
    out = 0
    for half in (0, 16):
        x, y = _bf16_exact(a >> half), _bf16_exact(b >> half)
        neg_prod = (((a >> half) ^ (b >> half)) & 0x8000) != 0
        if op == "mul":
            r, zero_sign = x * y, 0x8000 if neg_prod else 0
        else:
            z = _bf16_exact(c >> half)
            # IEEE, nearest even: an exact zero sum is -0 only when both terms are -0.
            r = x * y + z
            both_neg = neg_prod and ((c >> half) & 0x8000) != 0
            zero_sign = 0x8000 if (x * y == 0 and z == 0 and both_neg) else 0
        out |= round_to_bf16(r, zero_sign) << half
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def _prmt(a: int, b: int, sel: int) -> int:
    src = a | (b << 32)
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (s & 7))) & 0xFF
        if s & 8:  # sign-replicate the selected byte
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


_INSTR = re.compile(r"^([a-z0-9.]+)\s+(.*?);$")


def run(asm: str, constraints: str, inputs: list[int]) -> list[int]:
    """Execute ``asm`` (one element) on integer inputs (bit patterns); returns the outputs' bits."""
    kinds = [c.strip().lstrip("=") for c in constraints.split(",")]
    n_out = sum(1 for c in constraints.split(",") if c.strip().startswith("="))
    width = {"h": 16, "r": 32}
    for k in kinds:
        if k not in width:
            raise UnsupportedPTX(f"operand constraint {k!r}")
    if len(inputs) != len(kinds) - n_out:
        raise ValueError(f"{len(kinds) - n_out} inputs expected, got {len(inputs)}")
    regs: dict[str, int] = {}
    reg_bits: dict[str, int] = {}  # declared .b16 / .b32 registers
    for i, v in enumerate(inputs):
        regs[f"${n_out + i}"] = v & ((1 << width[kinds[n_out + i]]) - 1)

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return int(tok, 0) & M32
        raise UnsupportedPTX(f"operand {tok!r} (undefined register or unsupported form)")

    def put(dst: str, v: int) -> None:
        dst = dst.strip()
        if dst.startswith("$"):
            k = int(dst[1:])
            if k >= n_out:
                raise UnsupportedPTX(f"write to input operand {dst}")
            v &= (1 << width[kinds[k]]) - 1
        elif dst not in reg_bits:
            raise UnsupportedPTX(f"write to undeclared register {dst}")
        regs[dst] = v & ((1 << reg_bits.get(dst, 32)) - 1)

    body = asm.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    for raw in body.split("\n"):
        line = raw.strip()
        if not line:
            continue
        if line.startswith(".reg"):
            m = re.fullmatch(r"\.reg\s+\.b(16|32)\s+(.+);", line)
            if not m:
                raise UnsupportedPTX(line)
            for name in m.group(2).split(","):
                regs.setdefault(name.strip(), 0)
                reg_bits[name.strip()] = int(m.group(1))
            continue
        m = _INSTR.match(line)
        if not m:
            raise UnsupportedPTX(line)
        op, rest = m.group(1), m.group(2)
        if op == "mov.b32":
            dst, src = (s.strip() for s in rest.split(",", 1)) if not rest.startswith("{") else (None, None)
            if rest.startswith("{"):  # unpack: mov.b32 {lo, hi}, src
                m2 = re.fullmatch(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest)
                if not m2:
                    raise UnsupportedPTX(line)
                v = val(m2.group(3))
                put(m2.group(1), v & 0xFFFF)
                put(m2.group(2), v >> 16)
            elif src.startswith("{"):  # pack: mov.b32 dst, {lo, hi}
                m2 = re.fullmatch(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}", src)
                if not m2:
                    raise UnsupportedPTX(line)
                put(dst, (val(m2.group(1)) & 0xFFFF) | ((val(m2.group(2)) & 0xFFFF) << 16))
            else:
                put(dst, val(src))
            continue
        ops = [s.strip() for s in rest.split(",")]
        d, args = ops[0], ops[1:]
        if op in ("and.b32", "or.b32", "xor.b32"):
            a, b = (val(x) for x in args)
            put(d, {"and.b32": a & b, "or.b32": a | b, "xor.b32": a ^ b}[op])
        elif op == "not.b32":
            put(d, ~val(args[0]) & M32)
        elif op == "lop3.b32":
            put(d, _lop3(val(args[0]), val(args[1]), val(args[2]), val(args[3]) & 0xFF))
        elif re.fullmatch(r"shf\.[lr]\.(wrap|clamp)\.b32", op):
            lo, hi, n = val(args[0]), val(args[1]), val(args[2])
            n = n & 31 if ".wrap" in op else min(n, 32)
            both = lo | (hi << 32)
            put(d, ((both << n) >> 32) & M32 if op.startswith("shf.l") else (both >> n) & M32)
        elif op == "shr.s32":  # arithmetic: the sign bit fills
            a, n = val(args[0]), min(val(args[1]), 31)
            put(d, ((a - (1 << 32) if a >> 31 else a) >> n) & M32)
        elif op in ("shl.b32", "shr.b32"):
            a, n = val(args[0]), val(args[1])
            put(d, (a << n) & M32 if op == "shl.b32" else (a >> n if n < 32 else 0))
        elif op == "prmt.b32":
            put(d, _prmt(val(args[0]), val(args[1]), val(args[2])))
        elif op in ("add.u32", "add.s32", "sub.u32", "sub.s32"):
            a, b = val(args[0]), val(args[1])
            put(d, (a + b) & M32 if op.startswith("add") else (a - b) & M32)
        elif op == "mad.lo.u32":
            put(d, (val(args[0]) * val(args[1]) + val(args[2])) & M32)
        elif op == "fma.rn.bf16x2":
            put(d, _bf16x2("fma", val(args[0]), val(args[1]), val(args[2])))
        elif op == "mul.rn.bf16x2":
            put(d, _bf16x2("mul", val(args[0]), val(args[1]), None))
        else:
            raise UnsupportedPTX(f"opcode {op!r} in: {line}")
    missing = [f"${k}" for k in range(n_out) if f"${k}" not in regs]
    if missing:
        raise UnsupportedPTX(f"outputs never written: {missing}")
    return [regs[f"${k}"] for k in range(n_out)]
