package gograph

// The raw capture engine: stream capture, launch and destruction of graphs
// by handle, outside any pass record. make_graphed_callables does not use
// these (its captures go through the pass transaction, pass.go); they serve
// the core's own tests, diagnostics and anyone building on the registry.

import "fmt"

// BeginCapture starts capture on stream (a torch cuda_stream value) in mode
// (0 global, 1 thread_local, 2 relaxed). It returns true on success.
func BeginCapture(stream int64, mode int) (ok bool, err error) {
	defer recoverPanic("begin_capture", &err)
	return done(graphs.BeginCapture(stream, mode))
}

// EndCapture ends capture on stream, instantiates the graph and returns its
// handle. On failure nothing stays registered.
func EndCapture(stream int64) (graph int64, err error) {
	defer recoverPanic("end_capture", &err)
	return graphs.EndCapture(stream)
}

// AbortCapture ends whatever capture stream is in and destroys the result;
// no error when nothing was capturing. It returns true on success.
func AbortCapture(stream int64) (ok bool, err error) {
	defer recoverPanic("abort_capture", &err)
	return done(graphs.AbortCapture(stream))
}

// CaptureStatus returns stream's capture status: 0 none, 1 active, 2 invalidated.
func CaptureStatus(stream int64) (status int, err error) {
	defer recoverPanic("capture_status", &err)
	return graphs.CaptureStatus(stream)
}

// ExchangeCaptureMode sets the calling thread's capture mode and returns the
// previous one.
func ExchangeCaptureMode(mode int) (prev int, err error) {
	defer recoverPanic("exchange_capture_mode", &err)
	return graphs.ExchangeCaptureMode(mode)
}

// UploadGraph uploads graph to the device on stream. It returns true on
// success.
func UploadGraph(graph, stream int64) (ok bool, err error) {
	defer recoverPanic("upload_graph", &err)
	return done(graphs.Upload(graph, stream))
}

// LaunchGraph launches graph on stream; it returns true on success (a bool,
// not only an error: see the package doc on gopy's error-only wrappers).
func LaunchGraph(graph, stream int64) (launched bool, err error) {
	defer recoverPanic("launch_graph", &err)
	return done(graphs.Launch(graph, stream))
}

// DestroyGraph frees graph and unregisters its handle. A graph owned by a
// pass is refused: ResetPass destroys it (a pass must never launch a graph
// destroyed underneath it).
func DestroyGraph(graph int64) (ok bool, err error) {
	defer recoverPanic("destroy_graph", &err)
	if owner := passes.Owner(graph); owner != 0 {
		return false, fmt.Errorf("destroy_graph: graph %d belongs to pass %d; reset_pass destroys it", graph, owner)
	}
	return done(graphs.Destroy(graph))
}

// GraphNodeCount returns how many nodes graph has.
func GraphNodeCount(graph int64) (n int, err error) {
	defer recoverPanic("graph_node_count", &err)
	return graphs.NodeCount(graph)
}

// LiveGraphs returns how many graphs are registered now (leak checks).
func LiveGraphs() int { return graphs.LiveGraphs() }
