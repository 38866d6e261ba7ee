"""Tests of ``kpool-pd router`` against fake OpenAI servers."""
