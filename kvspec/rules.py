"""The rule registry: every numbered rule of the specification with its title, level and summary."""

from kvspec.core._rules import RULES, Level, Rule, get_rule

__all__ = ["RULES", "Level", "Rule", "get_rule"]
