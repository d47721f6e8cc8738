"""Paths and helpers shared by test modules (import them from here, not from another test module)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks" / "prompts"
