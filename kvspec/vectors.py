"""Language-neutral test vectors: write them from the reference, answer them, check another implementation."""

from kvspec.tools._vector_cases import write_vectors
from kvspec.tools._vectors import answer_vector
from kvspec.tools._vectors_check import CheckReport, check_vectors

__all__ = ["CheckReport", "answer_vector", "check_vectors", "write_vectors"]
