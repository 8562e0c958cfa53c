"""Shipped per-model head-config files (JSON); see README.md in this folder."""
