// Package gograph is the Go core's exported surface, compiled by gopy into
// the Python extensions gograph._core_cpu and gograph._core_cuda. Its exact
// contract is docs/CORE_API.md.
//
// The package is deliberately thin: logic lives in internal/cudagraph (the
// capture engine), internal/state (pass records), internal/schedule (pipeline
// schedules) and internal/lifetime (buffer lifetimes and slots; the last two
// are exported by plan.go). What it adds is the boundary discipline gopy
// needs:
//
//   - only int, int64, string, bool and error cross (gopy cannot take Python
//     lists or dicts, and handles are plain integers);
//   - a Go panic would abort the Python interpreter, so every function that
//     returns an error starts with `defer recoverPanic(...)`, which turns a
//     panic into a returned error (a Python RuntimeError); functions without
//     an error result are kept trivially panic-free;
//   - no exported variables or types, so gopy generates nothing but these
//     functions;
//   - no function has an error as its only result: gopy v0.4.10's wrapper of
//     that shape returns a C string it never frees (the empty string on
//     success, the message on failure: 30-50 bytes lost per call, measured),
//     so such functions return (ok bool, err error) instead, which frees
//     everything. hardening_test.go checks both rules for every export.
package gograph

import (
	"fmt"

	"github.com/gograph/gograph/internal/cudagraph"
	"github.com/gograph/gograph/internal/state"
)

// coreVersion is the semver of the core; Python checks it against its own.
const coreVersion = "0.1.0"

// One capture engine over this build's driver, and one ledger of passes that
// frees and launches its graphs through that engine. They are process-wide
// because the extension is loaded once per interpreter.
var (
	engine = cudagraph.NewRegistry(cudagraph.NewDriver())
	passes = state.NewLedger(engine)
)

// recoverPanic turns a panic in the exported function name into its returned
// error. It must be deferred directly (recover only works there).
func recoverPanic(name string, err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("%s: internal panic: %v", name, r)
	}
}

// done is the (ok, err) result of an operation that yields nothing but an
// error (see the package doc: no export returns an error alone).
func done(err error) (bool, error) { return err == nil, err }

// opErr prefixes an error from a driver query with the Python name of the
// function that made it, as the capture engine does for its own errors.
func opErr(name string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", name, err)
}

// ---- Build and driver information ----

// CoreVersion returns the semver of the core, e.g. "0.1.0".
func CoreVersion() string { return coreVersion }

// Flavor returns "cpu" or "cuda": which build of the core this is.
func Flavor() string { return cudagraph.Flavor }

// CudaHeaderVersion returns CUDA_VERSION of the cuda.h the core was compiled
// against (0 in the cpu flavor).
func CudaHeaderVersion() int { return cudagraph.HeaderVersion }

// DriverVersion returns the CUDA driver's version (cuDriverGetVersion, e.g. 13000).
func DriverVersion() (v int, err error) {
	defer recoverPanic("driver_version", &err)
	v, err = engine.Driver().DriverVersion()
	return v, opErr("driver_version", err)
}

// DeviceCount returns the number of CUDA devices.
func DeviceCount() (n int, err error) {
	defer recoverPanic("device_count", &err)
	n, err = engine.Driver().DeviceCount()
	return n, opErr("device_count", err)
}

// DeviceName returns the name of device ordinal.
func DeviceName(ordinal int) (name string, err error) {
	defer recoverPanic("device_name", &err)
	name, err = engine.Driver().DeviceName(ordinal)
	return name, opErr("device_name", err)
}

// DeviceTotalMemory returns the memory of device ordinal in bytes.
func DeviceTotalMemory(ordinal int) (bytes int64, err error) {
	defer recoverPanic("device_total_memory", &err)
	bytes, err = engine.Driver().DeviceTotalMemory(ordinal)
	return bytes, opErr("device_total_memory", err)
}

// ---- Capture engine ----

// BeginCapture starts capture on stream (a torch cuda_stream value) in mode
// (0 global, 1 thread_local, 2 relaxed). It returns true on success.
func BeginCapture(stream int64, mode int) (ok bool, err error) {
	defer recoverPanic("begin_capture", &err)
	return done(engine.BeginCapture(stream, mode))
}

// EndCapture ends capture on stream, instantiates the graph and returns its
// handle. On failure nothing stays registered.
func EndCapture(stream int64) (graph int64, err error) {
	defer recoverPanic("end_capture", &err)
	return engine.EndCapture(stream)
}

// AbortCapture ends whatever capture stream is in and destroys the result;
// no error when nothing was capturing. It returns true on success.
func AbortCapture(stream int64) (ok bool, err error) {
	defer recoverPanic("abort_capture", &err)
	return done(engine.AbortCapture(stream))
}

// CaptureStatus returns stream's capture status: 0 none, 1 active, 2 invalidated.
func CaptureStatus(stream int64) (status int, err error) {
	defer recoverPanic("capture_status", &err)
	return engine.CaptureStatus(stream)
}

// ExchangeCaptureMode sets the calling thread's capture mode and returns the
// previous one.
func ExchangeCaptureMode(mode int) (prev int, err error) {
	defer recoverPanic("exchange_capture_mode", &err)
	return engine.ExchangeCaptureMode(mode)
}

// UploadGraph uploads graph to the device on stream. It returns true on
// success.
func UploadGraph(graph, stream int64) (ok bool, err error) {
	defer recoverPanic("upload_graph", &err)
	return done(engine.Upload(graph, stream))
}

// LaunchGraph launches graph on stream; it returns true on success.
//
// It returns a bool (not only an error) because it is a per-iteration call:
// gopy v0.4.10's wrapper of an error-only function returns a C string it
// never frees (about 30 bytes lost per call, measured), while scalar results
// cost nothing.
func LaunchGraph(graph, stream int64) (launched bool, err error) {
	defer recoverPanic("launch_graph", &err)
	if err := engine.Launch(graph, stream); err != nil {
		return false, err
	}
	return true, nil
}

// DestroyGraph frees graph and unregisters its handle. Graphs attached to a
// pass are destroyed by ResetPass instead.
func DestroyGraph(graph int64) (ok bool, err error) {
	defer recoverPanic("destroy_graph", &err)
	return done(engine.Destroy(graph))
}

// GraphNodeCount returns how many nodes graph has.
func GraphNodeCount(graph int64) (n int, err error) {
	defer recoverPanic("graph_node_count", &err)
	return engine.NodeCount(graph)
}

// LiveGraphs returns how many graphs are registered now (leak checks).
func LiveGraphs() int { return engine.LiveGraphs() }

// ---- Pass records ----

// NewPass creates the record of graphed callable callableIndex, in state
// "building", and returns its id.
func NewPass(callableIndex int, label string) (pass int64, err error) {
	defer recoverPanic("new_pass", &err)
	return passes.NewPass(callableIndex, label)
}

// AttachGraph gives pass ownership of graph for kind (0 forward, 1 backward,
// 2 wgrad); graph 0 records a kind with nothing to launch.
func AttachGraph(pass int64, kind int, graph int64) (ok bool, err error) {
	defer recoverPanic("attach_graph", &err)
	if graph != 0 && !engine.Has(graph) {
		// A pass must own only graphs that exist, or its reset would fail
		// to destroy them (found by FuzzBoundary).
		return false, fmt.Errorf("attach_graph: unknown graph handle %d (never created or already destroyed)", graph)
	}
	return done(passes.AttachGraph(pass, state.Kind(kind), graph))
}

// AddPoolRef records that pass took one reference on its memory pool.
func AddPoolRef(pass int64) (ok bool, err error) {
	defer recoverPanic("add_pool_ref", &err)
	return done(passes.AddPoolRef(pass))
}

// SealPass moves pass from "building" to "ready".
func SealPass(pass int64) (ok bool, err error) {
	defer recoverPanic("seal_pass", &err)
	return done(passes.Seal(pass))
}

// Replay launches pass's graph of kind on stream: the replay hot path. It
// returns whether a graph was launched (false for a kind recorded with
// handle 0, the eager engine). Like LaunchGraph it returns a bool so that
// gopy's wrapper does not leak a string on every call.
func Replay(pass int64, kind int, stream int64) (launched bool, err error) {
	defer recoverPanic("replay", &err)
	return passes.Replay(pass, state.Kind(kind), stream)
}

// PassState returns "building", "ready" or "reset".
func PassState(pass int64) (s string, err error) {
	defer recoverPanic("pass_state", &err)
	life, err := passes.State(pass)
	if err != nil {
		return "", err
	}
	return life.String(), nil
}

// PassGraph returns the graph handle pass holds for kind (0 if none, eager
// or reset).
func PassGraph(pass int64, kind int) (graph int64, err error) {
	defer recoverPanic("pass_graph", &err)
	return passes.Graph(pass, state.Kind(kind))
}

// ResetPass destroys every graph pass owns, moves it to "reset" and returns
// how many pool references the caller must now release. A second call
// returns 0.
func ResetPass(pass int64) (refs int, err error) {
	defer recoverPanic("reset_pass", &err)
	return passes.ResetPass(pass)
}

// DropPass resets pass if needed and forgets it; an unknown id is not an
// error. Pool references still held are not returned: call ResetPass first
// to release them.
func DropPass(pass int64) (ok bool, err error) {
	defer recoverPanic("drop_pass", &err)
	_, err = passes.DropPass(pass)
	return done(err)
}

// LivePasses returns how many pass records exist (not dropped).
func LivePasses() int { return passes.LivePasses() }

// TriggerPanicForTest panics inside Go, to prove a panic comes back to Python
// as a RuntimeError instead of aborting the interpreter.
func TriggerPanicForTest() (ok bool, err error) {
	defer recoverPanic("trigger_panic_for_test", &err)
	panic("deliberate panic for testing the boundary")
}
