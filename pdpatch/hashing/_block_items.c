/* The serialized token ids of each block, for pdpatch.hashing.encoders.
 *
 * vLLM hashes block i as F(serialize((parent, tuple(tokens[i*B:(i+1)*B]), extra))) with
 * serialize = cbor2.dumps or pickle.dumps.  The part that depends on the tokens is the tuple's
 * items; these functions write those items for every block in one call, so no per-block
 * Python work is left but the framing and the digest:
 *
 *   cbor_items:   each id as a CBOR unsigned integer, shortest form (RFC 8949 4.2.1; cbor2
 *                 always writes that form);
 *   pickle_items: each id as the C pickler writes an int of that value (Modules/_pickle.c
 *                 save_long, protocol >= 2): BININT1 'K' for 0..255, BININT2 'M' for
 *                 256..65535, else BININT 'J' (4 bytes, signed little-endian) within int32.
 *
 * Both answer None -- the caller then takes the pure-Python paths, which decide exactly as
 * the serializers do -- for anything but a list/tuple of exact ints in their range (CBOR:
 * [0, 2**63); pickle: int32): bools, int subclasses, numpy scalars, larger ids.  They never
 * call back into Python while they read the sequence, so it cannot change under them.
 *
 *   first_non_id: where the input check of pdpatch.hashing.inputs must look closer -- the
 *                 index of the first item that is not an exact int in [0, 2**64), so that a
 *                 32k-token prompt of plain ids is checked in one C loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_ITEM 9      /* the longest item either encoding writes: CBOR 0x1b + 8 bytes */

/* Writes the item for v at out and returns its length, or 0 when v is out of range. */
typedef Py_ssize_t (*put_item)(unsigned char *out, long long v);

static Py_ssize_t put_cbor(unsigned char *out, long long value)
{
    if (value < 0)
        return 0;
    unsigned long long v = (unsigned long long)value;
    if (v < 24) {
        out[0] = (unsigned char)v;
        return 1;
    }
    if (v < 0x100) {
        out[0] = 0x18;
        out[1] = (unsigned char)v;
        return 2;
    }
    if (v < 0x10000) {
        out[0] = 0x19;
        out[1] = (unsigned char)(v >> 8);
        out[2] = (unsigned char)v;
        return 3;
    }
    if (v < 0x100000000ULL) {
        out[0] = 0x1a;
        for (int i = 0; i < 4; i++)
            out[1 + i] = (unsigned char)(v >> (24 - 8 * i));
        return 5;
    }
    out[0] = 0x1b;
    for (int i = 0; i < 8; i++)
        out[1 + i] = (unsigned char)(v >> (56 - 8 * i));
    return 9;
}

static Py_ssize_t put_pickle(unsigned char *out, long long v)
{
    if (v < INT32_MIN || v > INT32_MAX)
        return 0;       /* LONG1: variable length, left to Python */
    if (v >= 0 && v <= 0xff) {
        out[0] = 'K';
        out[1] = (unsigned char)v;
        return 2;
    }
    if (v >= 0 && v <= 0xffff) {
        out[0] = 'M';
        out[1] = (unsigned char)v;
        out[2] = (unsigned char)(v >> 8);
        return 3;
    }
    uint32_t u = (uint32_t)(int32_t)v;
    out[0] = 'J';
    for (int i = 0; i < 4; i++)
        out[1 + i] = (unsigned char)(u >> (8 * i));
    return 5;
}

static PyObject *encode_blocks(PyObject *args, const char *fmt, put_item put)
{
    PyObject *tokens;
    Py_ssize_t count, block_size;
    if (!PyArg_ParseTuple(args, fmt, &tokens, &count, &block_size))
        return NULL;
    if (count < 0 || block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "count must be >= 0 and block_size >= 1");
        return NULL;
    }
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens))
        Py_RETURN_NONE;
    if (count > PySequence_Fast_GET_SIZE(tokens) / block_size) {
        PyErr_SetString(PyExc_ValueError, "tokens holds fewer than count * block_size ids");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    unsigned char *buf = PyMem_Malloc((size_t)block_size * MAX_ITEM);
    if (buf == NULL)
        return PyErr_NoMemory();
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        PyMem_Free(buf);
        return NULL;
    }
    for (Py_ssize_t b = 0; b < count; b++) {
        PyObject **block = items + b * block_size;
        Py_ssize_t len = 0;
        for (Py_ssize_t i = 0; i < block_size; i++) {
            Py_ssize_t n = 0;
            if (PyLong_CheckExact(block[i])) {
                int overflow = 0;
                long long v = PyLong_AsLongLongAndOverflow(block[i], &overflow);
                n = overflow ? 0 : put(buf + len, v);
            }
            if (n == 0) {       /* not an exact int, or out of this encoding's range */
                Py_DECREF(out);
                PyMem_Free(buf);
                Py_RETURN_NONE;
            }
            len += n;
        }
        PyObject *encoded = PyBytes_FromStringAndSize((const char *)buf, len);
        if (encoded == NULL) {
            Py_DECREF(out);
            PyMem_Free(buf);
            return NULL;
        }
        PyList_SET_ITEM(out, b, encoded);
    }
    PyMem_Free(buf);
    return out;
}

static PyObject *cbor_items(PyObject *self, PyObject *args)
{
    return encode_blocks(args, "Onn:cbor_items", put_cbor);
}

static PyObject *pickle_items(PyObject *self, PyObject *args)
{
    return encode_blocks(args, "Onn:pickle_items", put_pickle);
}

static PyObject *first_non_id(PyObject *self, PyObject *tokens)
{
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) {
        PyErr_SetString(PyExc_TypeError, "first_non_id wants a list or a tuple");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(items[i]))
            return PyLong_FromSsize_t(i);
#if PY_VERSION_HEX < 0x030C0000
        /* up to 3.11 an int's size is its signed digit count: one or two digits are an id
         * (< 2**60) without a conversion call */
        Py_ssize_t digits = Py_SIZE(items[i]);
        if (digits >= 0 && digits <= 2)
            continue;
#endif
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow < 0 || (overflow == 0 && v < 0))
            return PyLong_FromSsize_t(i);
        if (overflow > 0) {     /* >= 2**63: an id while it fits 64 bits unsigned */
            PyLong_AsUnsignedLongLong(items[i]);
            if (PyErr_Occurred()) {
                PyErr_Clear();
                return PyLong_FromSsize_t(i);
            }
        }
    }
    return PyLong_FromSsize_t(-1);
}

PyDoc_STRVAR(first_non_id_doc,
"first_non_id(tokens) -> int\n\n"
"The index of the first item of a list or tuple that is not an exact int in [0, 2**64),\n"
"or -1 when every item is one.");

PyDoc_STRVAR(cbor_items_doc,
"cbor_items(tokens, count, block_size) -> list[bytes] | None\n\n"
"The CBOR items (no array header) of the ids of each of the first ``count`` blocks of\n"
"``block_size`` ids; None unless those are exact ints in [0, 2**63) in a list or tuple.");

PyDoc_STRVAR(pickle_items_doc,
"pickle_items(tokens, count, block_size) -> list[bytes] | None\n\n"
"The pickle items (no MARK/TUPLE framing) of the ids of each of the first ``count`` blocks\n"
"of ``block_size`` ids; None unless those are exact int32 ints in a list or tuple.");

static PyMethodDef methods[] = {
    {"cbor_items", cbor_items, METH_VARARGS, cbor_items_doc},
    {"pickle_items", pickle_items, METH_VARARGS, pickle_items_doc},
    {"first_non_id", first_non_id, METH_O, first_non_id_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pdpatch.hashing._block_items",
    "Serialized token ids of each block (see pdpatch.hashing.encoders).", -1, methods,
};

PyMODINIT_FUNC PyInit__block_items(void)
{
    return PyModule_Create(&module);
}
