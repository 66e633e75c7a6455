"""Bundled benchmark prompts (chat), written for this project."""

from __future__ import annotations

CHAT = [
    "Explain in three sentences why the sky is blue.",
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for writing clean Python code.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short poem about the ocean.",
    "How does a bicycle stay upright when it is moving?",
    "List five fruits that are rich in vitamin C.",
    "What causes the seasons on Earth?",
    "Describe how to make a cup of tea, step by step.",
    "Why do cats purr?",
    "Explain what a hash table is to a beginner.",
    "What are the main causes of climate change?",
    "Write a friendly email inviting a colleague to lunch.",
    "How do vaccines train the immune system?",
    "What is the Pythagorean theorem? Give an example.",
]
