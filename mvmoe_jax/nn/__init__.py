"""Flax modules of the MVMoE policy (attention, mixture-of-experts, encoder/decoder)."""
