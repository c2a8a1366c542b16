"""Isolation of code streamrl runs but did not write: the box for model-written code
(`streamrl.isolation.box`)."""
