package state

import "fmt"

// recoveringGraphs wraps a Graphs so that a panic in any of its calls comes
// back as that call's error. Without it a panic inside reset (records hold their lock
// with a deferred unlock, so that part is safe) would leave a record with
// some graphs zeroed, its lifecycle unchanged and its pool references never
// handed back; with it, reset's error path runs: the other graphs are still
// destroyed, the pass is Reset and its references returned.
type recoveringGraphs struct{ g Graphs }

func recoverGraphs(g Graphs) Graphs {
	if r, ok := g.(recoveringGraphs); ok {
		return r
	}
	return recoveringGraphs{g}
}

func catchPanic(op string, handle int64, err *error) {
	if v := recover(); v != nil {
		*err = fmt.Errorf("%s %d: internal panic: %v", op, handle, v)
	}
}

func (r recoveringGraphs) Launch(graph, stream int64) (err error) {
	defer catchPanic("launch of graph", graph, &err)
	return r.g.Launch(graph, stream)
}

func (r recoveringGraphs) Order(graph, stream int64) (err error) {
	defer catchPanic("ordering of graph", graph, &err)
	return r.g.Order(graph, stream)
}

func (r recoveringGraphs) Destroy(graph int64) (err error) {
	defer catchPanic("destroy of graph", graph, &err)
	return r.g.Destroy(graph)
}

func (r recoveringGraphs) BeginCapture(stream int64, mode int) (err error) {
	defer catchPanic("begin capture on stream", stream, &err)
	return r.g.BeginCapture(stream, mode)
}

func (r recoveringGraphs) EndCapture(stream int64) (graph int64, err error) {
	defer catchPanic("end capture on stream", stream, &err)
	return r.g.EndCapture(stream)
}

func (r recoveringGraphs) AbortCapture(stream int64) (err error) {
	defer catchPanic("abort capture on stream", stream, &err)
	return r.g.AbortCapture(stream)
}
