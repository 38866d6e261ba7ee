"""End to end: real prefill and decode daemons whose every PD run equals the colocated run byte for byte."""
