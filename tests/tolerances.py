"""Every tolerance the suite uses, with the reason it is what it is."""

# T towers vs one device on the whole batch, float32. The towers add per-tower
# partial sums where one device adds in one pass: the same numbers in a different
# order, so they differ by float32 rounding (~1e-7 relative per add), which a few
# SGD/Adam steps do not amplify beyond this. The design's promise is rtol 1e-5.
EQUIVALENCE_RTOL = 1e-5
# Absolute floor for values that should be ~0 (e.g. a weight that barely moved),
# where a relative tolerance means nothing: ~100 ulps of the typical weight (0.1).
EQUIVALENCE_ATOL = 1e-6

# Hand-computed combine results: the arithmetic is a few float32 adds of small
# integers and halves, exact in float32, so the tolerance is zero.
EXACT = 0.0

# Adam's update g / (sqrt(v) + eps) turns an absolute change in g into one of up to
# lr / eps in the weights. Towers and one device compute g with float32 sums in a
# different order, so a gradient that nearly cancels (|g| ~ 1e-9 from terms ~1e-2)
# differs by ~1e-10 between them; Keras' default eps=1e-7 would magnify that to
# ~1e-5 (seen: one bias element of 8, after 3 steps, depending on the initial
# weights). Equivalence tests use this eps so Adam's m, v and bias correction all
# run while the update stays well conditioned (amplification lr / eps = 10).
ADAM_EPSILON = 1e-3

# Mixed precision, towers vs one device (SGD, 3 steps). The variables are float32
# but each tower sums its examples' gradients in 16 bits, where one device sums the
# whole batch in 16 bits, and the towers add their sums in float32. So gradients
# differ at 16-bit rounding: float16 keeps an 11-bit significand (~5e-4 relative),
# bfloat16 an 8-bit one (~4e-3). The tests compare each variable's change over a
# few steps, ||towers - one device|| / ||one device||: measured up to 4.8e-4
# (float16) and 4.4e-3 (bfloat16) on 4 towers; the bounds leave 4x.
MIXED_FLOAT16_RTOL = 2e-3
MIXED_BFLOAT16_RTOL = 2e-2
# The same for a small CNN in float16: a convolution's filter gradient sums the
# products of every example and position (13 x 16 here) in 16 bits, so the first
# kernel's change differs more: measured 1.1e-3 to 1.4e-3 without
# BatchNormalization and 2.1e-3 with it (global statistics), on 2 and 4 towers.
MIXED_FLOAT16_CONV_RTOL = 1e-2

# Real models (keras.applications, keras_hub) in float64 against Keras' fit, each
# variable's update (after - before). float64 rounds at ~1e-16, and a deep network
# amplifies it, above all where BatchNormalization normalises over few values
# (MobileNetV2 at 32x32 ends on 1x1 positions): measured up to 4e-9 of an update
# (MobileNetV2, 3 steps on 3 towers), 2e-12 for ResNet50 and 8e-12 for
# ConvNeXtTiny (the suite now runs smaller configs of Keras' ResNet50 and
# ConvNeXtTiny builders, which round less). A float32 step anywhere in the
# path shows 1e-5 and more (1.7e-4 on ResNet50 before the float64 fix), so this
# bound still catches one.
FLOAT64_UPDATE_RTOL = 1e-7
# The absolute floor, as a fraction of the model's largest update: an update that
# is 0 on one device (a bias before BatchNormalization), or a tiny element of a
# large kernel, is rounding of the largest update's size there: measured 1.3e-12
# of it (ResNet50, 2 steps). The float32 path that bound catches was off by
# 7e-8 to 6e-5 of it.
FLOAT64_UPDATE_ATOL = 1e-9
# Gemma3 computes its attention softmax in float32 in a float64 model
# (keras_hub's Gemma3Attention: Softmax(dtype="float32")), and float32 kernels
# round a shard's rows and the whole batch's differently: measured 3.3e-8 of the
# largest update (2 steps, 2 towers, tests/test_real_models.py). An engine
# error (a shard's loss weighted wrong, a gradient not summed) is off by 1e-2
# and more; this floor leaves 30x above the rounding.
FLOAT32_SOFTMAX_UPDATE_ATOL = 1e-6
