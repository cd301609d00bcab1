"""Language-neutral test vectors: write them from the reference, answer them, check another implementation."""

from kvspec._vector_cases import write_vectors
from kvspec._vectors import answer_vector
from kvspec._vectors_check import CheckReport, check_vectors

__all__ = ["CheckReport", "answer_vector", "check_vectors", "write_vectors"]
