"""LeRobot's pretrained policies (SmolVLA, pi0) as vlaforge models: the joint layer every technique wraps
(`joint.py`), one composition over per-family data (`model.py`, `families.py`), the LeRobot folder reader
(`reader.py`) and the native processor pipelines (`processors.py`). vlaforge never imports LeRobot."""
