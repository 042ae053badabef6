package cudagraph

import "fmt"

// PanicError is a panic inside a Driver call, recovered and returned as the
// call's error. The exported surface recovers panics too, but only there: a
// panic that unwound through the Registry would skip its bookkeeping (a
// stream left marked "begin_capture in progress" forever, say). Recovering at
// the driver boundary keeps every Registry state transition on its error
// path instead.
type PanicError struct {
	Op    string // the Driver method, e.g. "EndCapture"
	Value any    // what was passed to panic
}

func (e *PanicError) Error() string {
	return fmt.Sprintf("driver %s: internal panic: %v", e.Op, e.Value)
}

// recovering wraps a Driver so that a panic in any of its calls comes back as
// a *PanicError. Wrapping twice is harmless.
func recovering(d Driver) Driver {
	if r, ok := d.(recoveringDriver); ok {
		return r
	}
	return recoveringDriver{d}
}

type recoveringDriver struct{ d Driver }

// catch turns a panic into *err; it must be deferred directly.
func catch(op string, err *error) {
	if v := recover(); v != nil {
		*err = &PanicError{Op: op, Value: v}
	}
}

func (r recoveringDriver) BeginCapture(s uintptr, m Mode) (err error) {
	defer catch("BeginCapture", &err)
	return r.d.BeginCapture(s, m)
}

// EndCapture keeps a graph the driver returned before panicking out of
// reach: none can be returned, as the panic unwound past the assignment.
func (r recoveringDriver) EndCapture(s uintptr) (g RawGraph, err error) {
	defer catch("EndCapture", &err)
	return r.d.EndCapture(s)
}

func (r recoveringDriver) Instantiate(g RawGraph) (e RawExec, err error) {
	defer catch("Instantiate", &err)
	return r.d.Instantiate(g)
}

func (r recoveringDriver) Launch(e RawExec, s uintptr) (err error) {
	defer catch("Launch", &err)
	return r.d.Launch(e, s)
}

func (r recoveringDriver) Upload(e RawExec, s uintptr) (err error) {
	defer catch("Upload", &err)
	return r.d.Upload(e, s)
}

func (r recoveringDriver) DestroyExec(e RawExec) (err error) {
	defer catch("DestroyExec", &err)
	return r.d.DestroyExec(e)
}

func (r recoveringDriver) DestroyGraph(g RawGraph) (err error) {
	defer catch("DestroyGraph", &err)
	return r.d.DestroyGraph(g)
}

func (r recoveringDriver) IsCapturing(s uintptr) (st CaptureStatus, err error) {
	defer catch("IsCapturing", &err)
	return r.d.IsCapturing(s)
}

func (r recoveringDriver) ExchangeMode(m Mode) (prev Mode, err error) {
	defer catch("ExchangeMode", &err)
	return r.d.ExchangeMode(m)
}

func (r recoveringDriver) NodeCount(g RawGraph) (n int, err error) {
	defer catch("NodeCount", &err)
	return r.d.NodeCount(g)
}

func (r recoveringDriver) EventCreate(s uintptr) (ev RawEvent, err error) {
	defer catch("EventCreate", &err)
	return r.d.EventCreate(s)
}

func (r recoveringDriver) EventRecord(ev RawEvent, s uintptr) (err error) {
	defer catch("EventRecord", &err)
	return r.d.EventRecord(ev, s)
}

func (r recoveringDriver) StreamWaitEvent(s uintptr, ev RawEvent) (err error) {
	defer catch("StreamWaitEvent", &err)
	return r.d.StreamWaitEvent(s, ev)
}

func (r recoveringDriver) DriverVersion() (v int, err error) {
	defer catch("DriverVersion", &err)
	return r.d.DriverVersion()
}

func (r recoveringDriver) DeviceCount() (n int, err error) {
	defer catch("DeviceCount", &err)
	return r.d.DeviceCount()
}

func (r recoveringDriver) DeviceName(ordinal int) (name string, err error) {
	defer catch("DeviceName", &err)
	return r.d.DeviceName(ordinal)
}

func (r recoveringDriver) DeviceTotalMemory(ordinal int) (b int64, err error) {
	defer catch("DeviceTotalMemory", &err)
	return r.d.DeviceTotalMemory(ordinal)
}
