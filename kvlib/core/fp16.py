"""Rounding bounds of fp16 round-to-nearest, used by every bound on a value stored in fp16."""

#: fp16 round-to-nearest: ``|k - fp16(k)| <= FP16_REL |fp16(k)| + FP16_SUB`` (normal and subnormal range)
FP16_REL = 2.0**-11 / (1.0 - 2.0**-11)
FP16_SUB = 2.0**-25
