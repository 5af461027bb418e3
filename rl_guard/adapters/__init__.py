"""Thin translations from training frameworks to the framework-agnostic ``Guard``; each imports its framework lazily."""
