"""Tests of the connector's decode role: where a pull lands, held blocks, settling."""
