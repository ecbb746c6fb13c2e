"""R3 routing replay: routed-experts payloads, alignment and replay control."""
