"""The public constructors: muon_adamw, muon, adamw, contrib_muon, torch_muon."""
