/* The scheduler's per-output row hand-out in C (the engine core's hot loop at large batches).
 *
 * `hand_out_rows` does what `vllm_sampling_mask.core.scheduler._hand_out_rows_python` does for
 * every output of one step: the Python loop is the reference, this is the same loop without the
 * interpreter (its bytecode, not its objects: every streamed row is still one bytes object, every
 * held row is written into its request's buffers). Both are compared on the same steps by
 * tests/test_native_loops.py. Built where a C compiler and Python's headers are found (an
 * optional extension, setup.py); without it the scheduler runs the Python loop.
 *
 * Every index and offset is checked: a step whose rows don't fit its blob raises instead of
 * handing out a wrong row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "../_slot_fields.h"

static PyObject *str_sampling_mask;

/* The fields the loop reads of every output, at their slot offsets (EngineCoreOutput: msgspec). */
enum { NEW_TOKEN_IDS, REQUEST_ID, FINISH_REASON };
static SlotFields output_fields;

/* The int at position r of a tuple or list of ints (-1 with an exception set on error). */
static Py_ssize_t
int_at(PyObject *seq, Py_ssize_t r)
{
    Py_ssize_t size = PyTuple_Check(seq) ? PyTuple_GET_SIZE(seq) : PyList_GET_SIZE(seq);
    if (r < 0 || r >= size) {
        PyErr_Format(PyExc_IndexError, "batch row %zd of a step with %zd rows", r, size);
        return -1;
    }
    PyObject *item = PyTuple_Check(seq) ? PyTuple_GET_ITEM(seq, r) : PyList_GET_ITEM(seq, r);
    return PyNumber_AsSsize_t(item, PyExc_IndexError);
}

/* blob[start:end] as a new bytes object, or NULL (IndexError) where the row is not in blob. */
static PyObject *
row_of(PyObject *blob, Py_ssize_t start, Py_ssize_t end)
{
    if (start < 0 || end < start || end > PyBytes_GET_SIZE(blob)) {
        PyErr_Format(PyExc_IndexError, "row [%zd, %zd) outside the step's %zd bytes", start, end,
                     PyBytes_GET_SIZE(blob));
        return NULL;
    }
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(blob) + start, end - start);
}

/* A held row whose room is made (its length's and its ids' places in its request's buffers) and
 * whose bytes are written after the step's pass (write_held_rows). The buffers are named by
 * object and offset, not by address: a later row of the same request in the pass (not expected,
 * but not ruled out) may re-allocate them. */
typedef struct {
    PyObject *lengths, *ids; /* borrowed: held alive by their request's rows in held */
    Py_ssize_t length_at, ids_at;
    const char *src; /* in the step's blob */
    Py_ssize_t size;
} HeldRow;

/* Make room for blob[start:end] as a held row in rows, a held request's [lengths, ids, fill]
 * list: 4 bytes at the end of the bytearray lengths (its id count, little-endian int32), its
 * bytes at ids[fill:], fill then moved past them; *row says where, for write_held_rows. ids is
 * its request's buffer for a whole send period: where it is too short it grows to room for
 * reserve_rows rows like this one (or twice what it needs), so that a request's buffer is
 * allocated about once a period, not every few rows as appending to a bytearray would (each
 * growth a copy of the rows so far).
 *
 * Each request's buffers lie apart in memory, mostly out of the CPU's caches by the next step;
 * writing a row at once waits for its cache lines, one request after another. The room made,
 * the lines are prefetched instead, all of a step's at once, and written after the pass. */
static int
make_held_row(PyObject *rows, PyObject *blob, Py_ssize_t start, Py_ssize_t end,
              Py_ssize_t reserve_rows, HeldRow *row)
{
    PyObject *lengths, *ids, *fill_obj;
    if (!PyList_CheckExact(rows) || PyList_GET_SIZE(rows) != 3
        || !PyByteArray_CheckExact(lengths = PyList_GET_ITEM(rows, 0))
        || !PyByteArray_CheckExact(ids = PyList_GET_ITEM(rows, 1))
        || !PyLong_CheckExact(fill_obj = PyList_GET_ITEM(rows, 2))) {
        PyErr_SetString(PyExc_TypeError, "a held request's rows must be a [lengths, ids, fill] "
                                         "list of two bytearrays and an int");
        return -1;
    }
    Py_ssize_t fill = PyLong_AsSsize_t(fill_obj);
    if (fill == -1 && PyErr_Occurred())
        return -1;
    if (fill < 0 || fill > PyByteArray_GET_SIZE(ids)) {
        PyErr_Format(PyExc_ValueError, "a held request's fill %zd outside its %zd bytes", fill,
                     PyByteArray_GET_SIZE(ids));
        return -1;
    }
    if (start < 0 || end < start || end > PyBytes_GET_SIZE(blob)) {
        PyErr_Format(PyExc_IndexError, "row [%zd, %zd) outside the step's %zd bytes", start, end,
                     PyBytes_GET_SIZE(blob));
        return -1;
    }
    Py_ssize_t n = end - start;
    if ((n >> 2) > 0x7fffffff) {
        PyErr_SetString(PyExc_OverflowError, "a row of more than 2**31 - 1 ids");
        return -1;
    }
    if (fill + n > PyByteArray_GET_SIZE(ids)) {
        Py_ssize_t room = reserve_rows * n > 2 * (fill + n) ? reserve_rows * n : 2 * (fill + n);
        if (PyByteArray_Resize(ids, room) < 0)
            return -1;
    }
    PyObject *new_fill = PyLong_FromSsize_t(fill + n);
    Py_ssize_t num_lengths = PyByteArray_GET_SIZE(lengths);
    if (new_fill == NULL || PyByteArray_Resize(lengths, num_lengths + 4) < 0) {
        Py_XDECREF(new_fill);
        return -1;
    }
    PyList_SET_ITEM(rows, 2, new_fill);
    Py_DECREF(fill_obj);
    *row = (HeldRow){lengths, ids, num_lengths, fill, PyBytes_AS_STRING(blob) + start, n};
#if defined(__GNUC__) || defined(__clang__)
    char *at = PyByteArray_AS_STRING(ids) + fill;
    for (Py_ssize_t line = 0; line < n; line += 64)
        __builtin_prefetch(at + line, 1);
    if (n > 0)
        __builtin_prefetch(at + n - 1, 1); /* a row need not start at a line */
    __builtin_prefetch(PyByteArray_AS_STRING(lengths) + num_lengths, 1);
#endif
    return 0;
}

/* Write the held rows made room for by make_held_row: each one's length and bytes. */
static void
write_held_rows(const HeldRow *rows, Py_ssize_t num_rows)
{
    for (const HeldRow *row = rows; row < rows + num_rows; row++) {
        Py_ssize_t count = row->size >> 2;
        unsigned char *length = (unsigned char *)PyByteArray_AS_STRING(row->lengths)
                                + row->length_at;
        length[0] = count & 0xff; /* little-endian whatever the host's order */
        length[1] = (count >> 8) & 0xff;
        length[2] = (count >> 16) & 0xff;
        length[3] = (count >> 24) & 0xff;
        memcpy(PyByteArray_AS_STRING(row->ids) + row->ids_at, row->src, row->size);
    }
}

/* 1 if output.finish_reason is not None, 0 if it is, -1 on error. */
static int
has_finished(PyObject *output)
{
    PyObject *reason = slot_field(&output_fields, output, FINISH_REASON);
    if (reason == NULL)
        return -1;
    int finished = reason != Py_None;
    Py_DECREF(reason);
    return finished;
}

/* The rows of one output with one new token (a held one made room for at held_rows[0], and
 * *num_held_rows counted); 0, or -1 on error. */
static int
hand_out_one(PyObject *output, PyObject *index, PyObject *held, PyObject *starts,
             PyObject *ends, PyObject *blob, int flush, Py_ssize_t reserve_rows, PyObject *send,
             HeldRow *held_rows, Py_ssize_t *num_held_rows)
{
    PyObject *request_id = slot_field(&output_fields, output, REQUEST_ID);
    if (request_id == NULL)
        return -1;
    PyObject *batch_row = PyDict_GetItemWithError(index, request_id); /* borrowed */
    if (batch_row == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, request_id);
        Py_DECREF(request_id);
        return -1;
    }
    PyObject *rows = PyDict_GetItemWithError(held, request_id); /* borrowed */
    Py_DECREF(request_id);
    if (rows == NULL && PyErr_Occurred())
        return -1;
    Py_ssize_t r = PyNumber_AsSsize_t(batch_row, PyExc_IndexError);
    if (r == -1 && PyErr_Occurred())
        return -1;
    Py_ssize_t start = int_at(starts, r);
    if (start == -1 && PyErr_Occurred())
        return -1;
    if (rows == NULL && start < 0)
        return 0; /* opted out: no row (the field's default) */
    Py_ssize_t end = int_at(ends, r);
    if (end == -1 && PyErr_Occurred())
        return -1;
    if (rows == NULL) {
        PyObject *row = row_of(blob, start, end);
        if (row == NULL)
            return -1;
        int failed = PyObject_SetAttr(output, str_sampling_mask, row);
        Py_DECREF(row);
        return failed;
    }
    if (make_held_row(rows, blob, start, end, reserve_rows, held_rows) < 0)
        return -1;
    ++*num_held_rows;
    int finished = flush ? 1 : has_finished(output);
    if (finished <= 0)
        return finished;
    return PyList_Append(send, output);
}

PyDoc_STRVAR(hand_out_rows_doc,
"hand_out_rows(outputs, index, held, starts, ends, blob, flush, reserve_rows)\n"
"    -> (several, send)\n\n"
"For every output (a list of EngineCoreOutputWithMask) with one new token: set its\n"
"sampling_mask to its row, blob[starts[r]:ends[r]] (r = index[request_id]; no row where\n"
"starts[r] < 0: opted out), or, for a request in held (request id -> [lengths, ids, fill]),\n"
"append the row's id count (int32 little-endian) to lengths and write its bytes at\n"
"ids[fill:], growing ids to room for reserve_rows such rows where it is short.\n"
"starts: tuple or list of int, ends: list of int, blob: bytes.\n"
"several: the outputs with more than one new token; send: the held requests' outputs that\n"
"carry their rows now (flush, or a finish), in order, for _send_held_rows.");

static PyObject *
hand_out_rows(PyObject *self, PyObject *args)
{
    PyObject *outputs, *index, *held, *starts, *ends, *blob;
    int flush;
    Py_ssize_t reserve_rows;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!O!pn:hand_out_rows", &PyList_Type, &outputs,
                          &PyDict_Type, &index, &PyDict_Type, &held, &starts, &PyList_Type,
                          &ends, &PyBytes_Type, &blob, &flush, &reserve_rows))
        return NULL;
    if (!PyTuple_Check(starts) && !PyList_Check(starts)) {
        PyErr_SetString(PyExc_TypeError, "starts must be a tuple or a list");
        return NULL;
    }
    PyObject *several = PyList_New(0), *send = PyList_New(0);
    int any_held = PyDict_GET_SIZE(held) > 0;
    /* at most one held row an output: written after the pass (make_held_row) */
    HeldRow *held_rows = any_held ? PyMem_New(HeldRow, PyList_GET_SIZE(outputs) + 1) : NULL;
    Py_ssize_t num_held_rows = 0;
    if (several == NULL || send == NULL || (any_held && held_rows == NULL))
        goto fail;
    /* outputs may not change size while this runs: nothing here calls back into Python code
       that could reach it, but index it by its size at each step all the same. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outputs); i++) {
        PyObject *output = PyList_GET_ITEM(outputs, i);
        Py_INCREF(output);
        PyObject *new_token_ids = slot_field(&output_fields, output, NEW_TOKEN_IDS);
        Py_ssize_t num_new = -1;
        if (new_token_ids != NULL) {
            num_new = PyObject_Length(new_token_ids);
            Py_DECREF(new_token_ids);
        }
        int failed = num_new < 0;
        if (num_new == 1) {
            failed = hand_out_one(output, index, held, starts, ends, blob, flush, reserve_rows,
                                  send, held_rows + num_held_rows, &num_held_rows) < 0;
        } else if (num_new > 1) {
            failed = PyList_Append(several, output) < 0;
        } else if (num_new == 0 && any_held) {
            int finished = has_finished(output); /* a finish without a token */
            failed = finished < 0 || (finished && PyList_Append(send, output) < 0);
        }
        Py_DECREF(output);
        if (failed)
            goto fail;
    }
    write_held_rows(held_rows, num_held_rows);
    PyMem_Free(held_rows);
    PyObject *result = PyTuple_Pack(2, several, send);
    Py_DECREF(several);
    Py_DECREF(send);
    return result;
fail: /* the rows before the failing output are held, as their buffers' lengths say */
    write_held_rows(held_rows, num_held_rows);
    PyMem_Free(held_rows);
    Py_XDECREF(several);
    Py_XDECREF(send);
    if (!PyErr_Occurred())
        PyErr_NoMemory();
    return NULL;
}

static PyMethodDef methods[] = {
    {"hand_out_rows", hand_out_rows, METH_VARARGS, hand_out_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hand_out_native",
    "The scheduler's row hand-out in C (see _hand_out_native.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__hand_out_native(void)
{
    static const char *const output_field_names[] = {"new_token_ids", "request_id",
                                                     "finish_reason", NULL};
    if (slot_fields_init(&output_fields, output_field_names) < 0
        || (str_sampling_mask = PyUnicode_InternFromString("sampling_mask")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
